"""``DPDeepSpeedStrategy``: Lightning's DeepSpeed strategy with DP-SGD, thin and delegating (DESIGN §4).

Where each piece runs:

* ``setup``: validate settings and the module (I5), attach the per-example engine, then DeepSpeed as usual,
  then a step pre-hook on the base optimizer for the noise;
* ``process_dataloader``: the training loader gets the distributed Poisson sampler and the privacy plan
  (q, σ, planned steps) is fixed;
* ``backward``: a probe on the loss reads every factor DeepSpeed and Lightning put on it (1/K, 1/gas, loss
  scale), so the engine recovers each example's own gradient before clipping;
* ``optimizer_step``: the ledger is charged at each accumulation boundary, before the update;
* ``save_checkpoint`` / ``load_checkpoint``: :class:`~lightning_dpzero.checkpoints.CheckpointProtocol`; the ledger
  travels in ``client_state`` and as ``privacy_ledger.json`` beside the ZeRO shards; rank 0 writes
  ``privacy_commit.json`` (ledger head, step, SHA-256 of every file) last, so a half-written checkpoint is
  detected and refused (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
import secrets
from typing import Any, Optional, Union

import torch
from torch.utils.data import DistributedSampler
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ._launch import DeepSpeedLaunchMixin
from .accounting import PrivacyLedger
from .checkpoints import CheckpointProtocol
from .noise import NoiseSource, make_noise_pre_hook
from .per_sample import PerSampleEngine
from .per_sample.clipping import validate_clipping, validate_group_thresholds
from .privacy_plan import PrivacyPlan
from .sampling import check_sampler_describable, dataset_size, poisson_sample_rate, private_dataloader


class NonFiniteLossError(RuntimeError):
    """``training_step`` returned a NaN or infinite loss; training stops with that step charged to the ledger."""


class _LossProbe(torch.autograd.Function):
    """Identity on the loss whose backward reports d(final scaled loss)/d(loss) to the strategy."""

    @staticmethod
    def forward(ctx, loss, strategy):
        ctx.strategy = strategy
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.strategy._on_loss_grad(g)
        return g, None


class DPDeepSpeedStrategy(DeepSpeedLaunchMixin, DeepSpeedStrategy):
    """DeepSpeed ZeRO (stages 0–3) with differentially private SGD (Abadi et al. 2016; Bu et al., DP-ZeRO).

    The released gradient of each optimizer step is ``(Σ_i clip(g_i) + N(0, σ²C²I)) / B_exp`` with
    ``B_exp = q·N`` (DESIGN §2). Takes every argument of Lightning's ``DeepSpeedStrategy`` plus:

    Args:
        noise_multiplier: σ. ``None`` lets ``PrivacyAccountantCallback(target_epsilon=...)`` calibrate it.
        max_grad_norm: C, bound on each example's gradient norm (``math.inf`` with σ=0 only, for testing).
        clipping: ``"layer-wise"`` (each of the K layers to C/√K; finishes inside each layer's backward,
            every stage), ``"all-layer"`` (one norm over all layers; book-keeping) or ``"group-wise"``.
        clipping_groups: for group-wise: lists of parameter-name patterns (``fnmatch``, e.g.
            ``[["encoder.*"], ["head.*"]]``), or ``"param_groups"`` for the optimizer's parameter groups.
        group_max_grad_norms: per-group thresholds C_k; default C/√K (so that √(Σ C_k²) = C); a
            √(Σ C_k²) above C is refused (the noise is calibrated to C).
        clipping_fn: ``"abadi"``: min(1, C/‖g‖), or ``"automatic"`` (Bu et al.): C/(‖g‖ + γ).
        gamma: γ of ``"automatic"`` clipping (default 0.01).
        poisson_sampling: Poisson-sample logical batches (default). ``False``: shuffled fixed-size batches,
            accounted as if Poisson with q = B·W·K/N (a common approximation; the ledger records it).
        secure_mode: noise and sampling from OS entropy; nothing can reproduce them.
        seed: seed of noise and sampling when not in secure mode; ``None`` draws one from OS entropy.
        loss_reduction: ``"mean"`` (``training_step`` returns the mean of per-example losses) or ``"sum"``.

    Raises:
        ValueError: bad settings, before the first step.
        UnsupportedLayerError: a trainable layer no per-example rule covers, before the first step.
    """

    strategy_name = "dp_deepspeed"

    def __init__(self, accelerator=None, zero_optimization: bool = True, stage: int = 2,
                 noise_multiplier: Optional[float] = None, max_grad_norm: float = 1.0,
                 clipping: str = "layer-wise", clipping_fn: str = "abadi", gamma: float = 0.01,
                 clipping_groups: Optional[Union[str, list[list[str]]]] = None,
                 group_max_grad_norms: Optional[list[float]] = None,
                 poisson_sampling: bool = True, secure_mode: bool = False, seed: Optional[int] = None,
                 loss_reduction: str = "mean", **kwargs: Any) -> None:
        super().__init__(accelerator=accelerator, zero_optimization=zero_optimization, stage=stage, **kwargs)
        validate_clipping(clipping, clipping_fn, max_grad_norm, gamma)
        if noise_multiplier is not None and not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"noise_multiplier (σ) must be >= 0 and finite, got {noise_multiplier!r}.")
        if noise_multiplier and math.isinf(max_grad_norm):
            raise ValueError("max_grad_norm=inf with noise_multiplier > 0 would add infinite noise; set a finite C.")
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm, self.clipping, self.clipping_fn, self.gamma = max_grad_norm, clipping, clipping_fn, gamma
        if clipping == "group-wise" and clipping_groups is None:
            raise ValueError("clipping='group-wise' needs clipping_groups: lists of parameter-name patterns, e.g. "
                             "[['encoder.*'], ['head.*']], or 'param_groups' (the optimizer's parameter groups).")
        if clipping_groups is not None and clipping != "group-wise":
            raise ValueError(f"clipping_groups is only used with clipping='group-wise', not {clipping!r}.")
        if group_max_grad_norms is not None:
            validate_group_thresholds(group_max_grad_norms, max_grad_norm)
        self.clipping_groups, self.group_max_grad_norms = clipping_groups, group_max_grad_norms
        self.poisson_sampling, self.secure_mode, self.loss_reduction = poisson_sampling, secure_mode, loss_reduction
        self.seed = seed
        self.per_sample: Optional[PerSampleEngine] = None
        self.plan: Optional[PrivacyPlan] = None
        self.ledger: Optional[PrivacyLedger] = None
        self.accountant_callback = None
        self._restored_ledger: Optional[PrivacyLedger] = None
        self._noise_applied = False
        self.checkpoint_protocol = CheckpointProtocol(self)

    @property
    def zero_stage(self) -> int:
        return int((self.config or {}).get("zero_optimization", {}).get("stage", 0) or 0)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._validate_trainer(trainer)
            patterns = None if self.clipping_groups == "param_groups" else self.clipping_groups
            self.per_sample = PerSampleEngine(self.model, self.max_grad_norm, self.clipping, self.clipping_fn,
                                              self.gamma, self.loss_reduction, groups=patterns,
                                              group_max_grad_norms=self.group_max_grad_norms)
            self.per_sample.attach()
            if self.zero_stage == 3 and self.per_sample.zero3_leaf_types:
                from deepspeed.utils import set_z3_leaf_modules

                set_z3_leaf_modules(self.model, self.per_sample.zero3_leaf_types)
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            if self.clipping_groups == "param_groups":
                self.per_sample.set_groups(self._user_param_groups, self.group_max_grad_norms)
            self._check_deferred_writes(trainer)
            self._install_noise_hook()

    def _init_optimizers(self):
        optimizer, scheduler = super()._init_optimizers()
        # DeepSpeed replaces param_groups by flat partitions; keep the user's grouping for group-wise clipping.
        self._user_param_groups = [list(g["params"]) for g in optimizer.param_groups]
        return optimizer, scheduler

    def _check_deferred_writes(self, trainer) -> None:
        if self.per_sample.needs_deferred_writes and trainer.accumulate_grad_batches > 1 and self.zero_stage >= 1:
            raise ValueError(
                f"clipping={self.clipping!r} with a clipping group that spans several layers and "
                f"accumulate_grad_batches > 1 is supported on ZeRO stage 0 only (stage {self.zero_stage} reduces "
                "such gradients in one coalesced pass per optimizer step, which DeepSpeed cannot yet span over "
                "micro-batches). Use clipping='layer-wise', stage=0, or accumulate_grad_batches=1 with a larger "
                "batch_size.")

    def _validate_trainer(self, trainer) -> None:
        if trainer.gradient_clip_val:
            raise ValueError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) would clip the *noisy* batch gradient; "
                "DP training clips each example instead. Remove gradient_clip_val and set the strategy's "
                "max_grad_norm.")
        if not trainer.lightning_module.automatic_optimization:
            raise ValueError(
                "automatic_optimization=False is not supported: the privacy ledger charges one step per "
                "optimizer step of Lightning's loop and expects one backward per sampled micro-batch, so manual "
                "accumulation would be under-charged and several manual_backward calls per batch would let an "
                "example contribute more than max_grad_norm. Use automatic optimization (return the loss from "
                "training_step; accumulate with Trainer(accumulate_grad_batches=...)).")
        if self.config and self.config.get("gradient_clipping"):
            raise ValueError(
                f"The DeepSpeed config sets gradient_clipping={self.config['gradient_clipping']}; per-example "
                "clipping replaces it. Remove it from the config and set the strategy's max_grad_norm.")
        if self.seed is None:
            # Stage 0 needs one seed on every rank; broadcast keeps them equal.
            self.seed = int(self.broadcast(secrets.randbits(62))) if self.world_size > 1 else secrets.randbits(62)

    def _install_noise_hook(self) -> None:
        engine = self.deepspeed_engine
        base = engine.optimizer
        while hasattr(base, "optimizer") and not isinstance(base, torch.optim.Optimizer):
            base = base.optimizer
        if not isinstance(base, torch.optim.Optimizer):
            raise TypeError(f"DP noise needs a torch.optim.Optimizer under DeepSpeed, found {type(base).__name__}; "
                            "define the optimizer in configure_optimizers, not in the DeepSpeed config.")
        source = NoiseSource(self.seed, self.secure_mode, replicated=self.zero_stage == 0, rank=self.global_rank)
        self._noise_handle = base.register_step_pre_hook(
            make_noise_pre_hook(self._noise_scales, source, self._mark_noise_applied))

    def _noise_scales(self) -> tuple[float, float]:
        assert self.plan is not None
        b_exp = self.plan.expected_batch_size
        sigma = self.plan.noise_multiplier
        std = sigma * self.max_grad_norm / b_exp if sigma > 0 else 0.0
        return self.world_size / b_exp, std

    def _mark_noise_applied(self) -> None:
        self._noise_applied = True

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or self.per_sample is None:
            return super().process_dataloader(dataloader)
        n = dataset_size(dataloader)
        check_sampler_describable(dataloader)
        batch_size = getattr(dataloader, "batch_size", None)
        if batch_size is None:
            raise ValueError("The training DataLoader must be built with batch_size=B (the per-device "
                             "micro-batch): the DP sampler replaces its sampler and needs B to set q.")
        if batch_size == 1 and isinstance(getattr(dataloader, "sampler", None), DistributedSampler):
            rank_zero_warn(
                "The training DataLoader has batch_size=1 after Lightning's DistributedSampler injection, so the "
                "sample rate q is set for micro-batches of 1 example. If you built it with batch_sampler="
                "BatchSampler(...), Lightning dropped that batch sampler: pass batch_size=B instead (the DP sampler "
                "replaces the sampling anyway), or set Trainer(use_distributed_sampler=False) to have it refused.")
        k = trainer.accumulate_grad_batches
        q = poisson_sample_rate(batch_size, self.world_size, k, n)
        loader = private_dataloader(dataloader, q, self.world_size, self.global_rank, k, seed=self.seed,
                                    secure_mode=self.secure_mode, poisson=self.poisson_sampling)
        self.plan = PrivacyPlan.build(self, trainer, loader, n, q)
        self._open_ledger()
        return loader

    def _open_ledger(self) -> None:
        plan = self.plan
        restored = self._restored_ledger
        if restored is not None:
            if restored.dataset_size != plan.dataset_size or restored.delta != plan.delta:
                raise ValueError(
                    f"The checkpoint's privacy ledger is for N={restored.dataset_size}, δ={restored.delta}; this "
                    f"run has N={plan.dataset_size}, δ={plan.delta}. Resume with the same data and delta.")
            self.ledger = restored
        elif self.ledger is None:
            # one run id on every rank, so every rank's copy of the ledger is the same document
            run_id = self.broadcast(secrets.token_hex(16))
            self.ledger = PrivacyLedger(delta=plan.delta, dataset_size=plan.dataset_size,
                                        accountant=plan.accountant, run_id=run_id)

    # ------------------------------------------------------------------ step
    def training_step(self, *args: Any, **kwargs: Any):
        if self.per_sample is not None:
            self.per_sample.start_micro_batch(extract_batch_size(args[0]) if args else None)
        if self.per_sample is None or self.per_sample.expected_batch_size != 0:
            with self._explain_released_parameters():
                return self._check_finite_loss(super().training_step(*args, **kwargs))
        # An empty Poisson batch is a valid noise-only step that every rank must run (collectives). The mean
        # loss over no examples is NaN: its self.log calls are dropped, so no epoch mean turns NaN, and the
        # loss handed to backward is 0 (its gradient is exactly zero either way).
        with _logging_suppressed(self.lightning_module), self._explain_released_parameters():
            out = super().training_step(*args, **kwargs)
        return self._check_finite_loss(_zero_loss(out))

    @contextlib.contextmanager
    def _explain_released_parameters(self):
        """ZeRO-3 gathers a parameter only inside the forward of the module that owns it; used elsewhere (in
        training_step) it is an empty partition and PyTorch reports a bare size mismatch against 0."""
        try:
            yield
        except RuntimeError as e:
            msg = str(e)
            if self.zero_stage != 3 or not re.search(r"(size|shape)[^\n]*\b0\b", msg):
                raise
            raise RuntimeError(
                f"{msg}\n\nUnder ZeRO-3 (DeepSpeed stage 3) a parameter holds data only inside the forward of the "
                "module that owns it; if training_step (outside any forward) uses a parameter, e.g. a learned "
                "temperature self.log_t.exp(), that parameter is an empty partition there. Use it inside a "
                "module's forward instead (a parameter used outside its layer is refused by the DP engine anyway, "
                "since its gradient would not be clipped per example).") from e

    def _check_finite_loss(self, out):
        """Stop on a NaN/inf loss (any rank; all ranks agree in one all-reduce), with the step charged.

        A non-finite loss would give NaN per-example norms and coefficients, and a NaN update: never skip it
        silently. The step is charged before raising (conservative: whether the loss was finite depends on the
        batch and is now visible), nothing is applied, and every rank raises the same error."""
        if self.per_sample is None or self.plan is None or self.ledger is None:
            return out
        loss = out.get("loss") if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            return out
        bad = torch.logical_not(torch.isfinite(loss.detach()).all()).to(torch.float32).reshape(1)
        if self.world_size > 1:
            bad = self.reduce(bad, reduce_op="sum")
        if float(bad) == 0:
            return out
        self.ledger.charge(self.plan.sample_rate, self.plan.noise_multiplier, self.plan.sampler_kind)
        try:
            eps = f"ε = {self.ledger.epsilon():.6g} at δ = {self.ledger.delta:g}"
        except Exception:  # noqa: BLE001 - the error below matters more than the number
            eps = "ε unavailable"
        trainer = self.lightning_module.trainer
        local = float(loss.detach().float().flatten()[0]) if loss.numel() else float("nan")
        raise NonFiniteLossError(
            f"training_step returned a non-finite loss at optimizer step {trainer.global_step + 1} (epoch "
            f"{trainer.current_epoch}; this rank's loss: {local}) on {int(float(bad))} of {self.world_size} "
            f"rank(s). Training stopped before the update; DP training never skips such a step silently. The step "
            f"was charged to the privacy ledger ({self.ledger.steps} steps, {eps}). Fix the cause (a loss that "
            "overflows, e.g. log of 0 or exp of large logits: compute it from logits, as cross_entropy does; too "
            "large a learning rate; bad values in the data), then resume from the last checkpoint.")

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.per_sample is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        closure_loss = _LossProbe.apply(closure_loss, self)
        ctx = contextlib.nullcontext()
        if self.per_sample.needs_deferred_writes and self.zero_stage >= 1:
            ctx = self.deepspeed_engine.coalesce_grad_reduction()
        with ctx:
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _on_loss_grad(self, g: torch.Tensor) -> None:
        g = float(g)
        if not math.isfinite(g) or g == 0:
            raise RuntimeError(f"The loss gradient is {g}; cannot recover per-example gradients.")
        k = self.lightning_module.trainer.accumulate_grad_batches
        gas = self.deepspeed_engine.gradient_accumulation_steps()
        # undo Lightning's 1/K, DeepSpeed's 1/gas and the loss scale; emit × S, which DeepSpeed divides out
        self.per_sample.set_loss_factors(grad_scale=k / g, emit_scale=g * gas)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any):
        if self.per_sample is None or self.plan is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        engine = self.deepspeed_engine
        boundary = engine.is_gradient_accumulation_boundary()

        def charged_closure():
            result = closure()
            if boundary:  # I4: charged before the update, skipped (overflow) steps too
                self.ledger.charge(self.plan.sample_rate, self.plan.noise_multiplier, self.plan.sampler_kind)
            return result

        self._noise_applied = False
        out = super().optimizer_step(optimizer, charged_closure, model, **kwargs)
        if boundary and engine.was_step_applied() and not self._noise_applied:
            raise RuntimeError("DeepSpeed applied an optimizer step without the DP noise hook running; refusing "
                               "to continue with a non-private update.")
        return out

    # ------------------------------------------------------------------ checkpoints (docs/reliability.md)
    #: Let DeepSpeed unpickle checkpoint files that the ``weights_only`` pre-scan refuses (objects other than
    #: tensors, containers, numbers, strings and DeepSpeed's own loss-scaler/stage classes). Unpickling can run
    #: arbitrary code: set it only for checkpoints you wrote yourself.
    trust_checkpoint_pickles: bool = False

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """DeepSpeed's checkpoint, the ledger twice, then the commit marker: :meth:`CheckpointProtocol.save`."""
        self.checkpoint_protocol.save(
            checkpoint, filepath, self.ledger, zero_stage=self.zero_stage,
            write_shards=lambda c, path: super(DPDeepSpeedStrategy, self).save_checkpoint(c, path, storage_options))

    def remove_checkpoint(self, filepath) -> None:
        self.checkpoint_protocol.invalidate(filepath)
        super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        """Verify the directory, then let DeepSpeed load it; when fitting, restore and cross-check the ledger
        (:meth:`CheckpointProtocol.verify` and :meth:`CheckpointProtocol.loaded_ledger`).

        Raises:
            IncompleteCheckpointError: no marker (the save was interrupted, or not written by this strategy).
            CheckpointIntegrityError: the files, the ledgers or the marker disagree.
            UnsafeCheckpointError: a file holds objects that unpickling could execute.
            ValueError: no ledger at all when resuming training.
        """
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        commit = self.checkpoint_protocol.verify(checkpoint_path, required=fitting,
                                                 trust_pickles=self.trust_checkpoint_pickles)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if not fitting:
            return checkpoint
        ledger = self.checkpoint_protocol.loaded_ledger(checkpoint_path, checkpoint, commit)
        self._restored_ledger = ledger
        self._fresh_streams_after_resume(ledger)
        return checkpoint

    def _fresh_streams_after_resume(self, ledger: PrivacyLedger) -> None:
        """With an explicit seed, a resumed process would restart the noise stream at its first draw, so the
        steps after the checkpoint would reuse the noise of the run's first steps: the difference of two
        released updates would then cancel the noise exactly. Derive a new seed from the seed and the ledger's
        position (deterministic, the same on every rank) for the noise and for the sampler built after this."""
        if self.secure_mode or self.seed is None or getattr(self, "_noise_handle", None) is None:
            return
        digest = hashlib.sha256(f"{self.seed}:{ledger.run_id}:{ledger.steps}:{ledger.head}".encode()).digest()
        self.seed = int.from_bytes(digest[:8], "little") >> 2
        self._noise_handle.remove()
        self._install_noise_hook()

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # Lightning injects its DistributedSampler into the training loader before process_dataloader replaces it,
        # so a dataset without __len__ fails there with Python's bare "has no len()": name the setting and the fix.
        tb, frames = exception.__traceback__, []
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        module = self.lightning_module
        training = module is not None and module._trainer is not None and module.trainer.training
        if training and isinstance(exception, TypeError) and "_get_distributed_sampler" in frames:
            from lightning.pytorch.utilities.exceptions import _augment_message

            _augment_message(exception, ".*has no len\\(\\).*", (
                f"{exception} - DP accounting needs the training set's size N: give the training dataset a __len__ "
                "(a map-style Dataset with __len__ and __getitem__); Poisson sampling and the accountant both need "
                "N."))

    def teardown(self) -> None:
        if self.per_sample is not None:
            self.per_sample.detach()
        super().teardown()

    # ------------------------------------------------------------------ registry
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        names = {
            "dp_deepspeed": {},
            "dp_deepspeed_stage_0": {"stage": 0},
            "dp_deepspeed_stage_1": {"stage": 1},
            "dp_deepspeed_stage_2": {"stage": 2},
            "dp_deepspeed_stage_2_offload": {"stage": 2, "offload_optimizer": True},
            "dp_deepspeed_stage_3": {"stage": 3},
            "dp_deepspeed_stage_3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
        }
        for name, kw in names.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"DP-SGD on DeepSpeed {kw or 'ZeRO stage 2'}",
                                           **kw)


@contextlib.contextmanager
def _logging_suppressed(module):
    module.log = module.log_dict = lambda *args, **kwargs: None  # instance attributes shadow the methods
    try:
        yield
    finally:
        del module.log, module.log_dict


def _zero_loss(out):
    if isinstance(out, torch.Tensor):
        return torch.nan_to_num(out, nan=0.0) if out.numel() == 1 else out
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return {**out, "loss": torch.nan_to_num(out["loss"], nan=0.0)}
    return out
