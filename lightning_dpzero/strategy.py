"""``DPDeepSpeedStrategy``: Lightning's DeepSpeed strategy with DP-SGD, thin and delegating (DESIGN §4).

Where each piece runs:

* ``setup``: validate settings and the module (I5), attach the per-example engine, then DeepSpeed as usual,
  then a step pre-hook on the base optimizer for the noise;
* ``process_dataloader``: the training loader gets the distributed Poisson sampler and the privacy plan
  (q, σ, planned steps) is fixed;
* ``backward``: a probe on the loss reads every factor DeepSpeed and Lightning put on it (1/K, 1/gas, loss
  scale), so the engine recovers each example's own gradient before clipping;
* ``optimizer_step``: the ledger is charged at each accumulation boundary, before the update;
* ``save_checkpoint`` / ``load_checkpoint``: the ledger travels in ``client_state`` and as
  ``privacy_ledger.json`` beside the ZeRO shards; rank 0 writes ``privacy_commit.json`` (ledger head, step,
  SHA-256 of every file) last, so a half-written checkpoint is detected and refused (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.strategies.ddp import DDPStrategy

from .accounting import PrivacyLedger
from .noise import NoiseSource, make_noise_pre_hook
from .per_sample import PerSampleEngine
from .per_sample.clipping import validate_clipping
from .privacy_plan import PrivacyPlan
from .sampling import check_sampler_describable, dataset_size, poisson_sample_rate, private_dataloader

LEDGER_FILE = "privacy_ledger.json"
LEDGER_KEY = "privacy_ledger"
COMMIT_FILE = "privacy_commit.json"  # written last by rank 0: the checkpoint is complete (docs/reliability.md)
INCOMPLETE_FILE = ".privacy_checkpoint_incomplete"  # written first, removed after the commit
COMMIT_FORMAT = "lightning_dpzero.privacy_commit"
COMMIT_FORMAT_VERSION = 1


class IncompleteCheckpointError(ValueError):
    """A checkpoint directory without its commit marker: the save was interrupted (or never finished)."""


class CheckpointIntegrityError(ValueError):
    """A checkpoint whose files, ledgers or commit marker disagree (edited, truncated, mixed from two saves)."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds pickled objects that ``torch.load(weights_only=True)`` refuses to build."""


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


class DPDeepSpeedStrategy(DeepSpeedStrategy):
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
        group_max_grad_norms: per-group thresholds C_k; default C/√K (so that √(Σ C_k²) = C).
        clipping_fn: ``"abadi"`` or ``"automatic"`` (Bu et al.), with ``gamma`` (default 0.01).
        poisson_sampling: Poisson-sample logical batches (default). ``False``: shuffled fixed-size batches,
            accounted as if Poisson with q = B·W·K/N (a common approximation; the ledger records it).
        secure_mode: noise and sampling from OS entropy; nothing can reproduce them.
        seed: seed of noise and sampling when not in secure mode; ``None`` draws one from OS entropy.
        loss_reduction: ``"mean"`` (``training_step`` returns the mean of per-example losses) or ``"sum"``.

    Raises:
        ValueError / UnsupportedLayerError: bad settings or modules, before the first step.
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
        self.clipping_groups, self.group_max_grad_norms = clipping_groups, group_max_grad_norms
        self.poisson_sampling, self.secure_mode, self.loss_reduction = poisson_sampling, secure_mode, loss_reduction
        self.seed = seed
        self.per_sample: Optional[PerSampleEngine] = None
        self.plan: Optional[PrivacyPlan] = None
        self.ledger: Optional[PrivacyLedger] = None
        self.accountant_callback = None
        self._restored_ledger: Optional[PrivacyLedger] = None
        self._noise_applied = False
        self._coalesce = None

    # ------------------------------------------------------------------ CPU support (DESIGN §4 item 5)
    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            return super().setup_environment()
        DDPStrategy.setup_environment(self)  # skip DeepSpeedStrategy's CUDA-only check: CPU + gloo works

    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            return super().setup_distributed()
        from lightning.fabric.utilities.seed import reset_seed
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @contextlib.contextmanager
    def _cpu_device_indices(self):
        """Lightning passes ``device_rank=root_device.index`` to ``deepspeed.initialize``; a CPU device has no
        index (None), which DeepSpeed cannot compare. For that call the CPU devices carry their local ranks."""
        if isinstance(self.accelerator, CUDAAccelerator) or self.parallel_devices is None:
            yield
            return
        saved = self.parallel_devices
        self.parallel_devices = [torch.device("cpu", i) for i in range(len(saved))]
        try:
            yield
        finally:
            self.parallel_devices = saved

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        with self._cpu_device_indices():
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)

    def _initialize_deepspeed_inference(self, model) -> None:  # trainer.validate / test / predict
        with self._cpu_device_indices():
            return super()._initialize_deepspeed_inference(model)

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
            self.per_sample.expected_batch_size = extract_batch_size(args[0]) if args else None
            self.per_sample.new_forward()
        if self.per_sample is None or self.per_sample.expected_batch_size != 0:
            return self._check_finite_loss(super().training_step(*args, **kwargs))
        # An empty Poisson batch is a valid noise-only step that every rank must run (collectives). The mean
        # loss over no examples is NaN: its self.log calls are dropped, so no epoch mean turns NaN, and the
        # loss handed to backward is 0 (its gradient is exactly zero either way).
        with _logging_suppressed(self.lightning_module):
            out = super().training_step(*args, **kwargs)
        return self._check_finite_loss(_zero_loss(out))

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
        self.per_sample.grad_scale = k / g  # undo Lightning's 1/K, DeepSpeed's 1/gas and the loss scale
        self.per_sample.emit_scale = g * gas  # = loss scale S, which DeepSpeed divides out before the step

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
        """DeepSpeed's checkpoint, the ledger twice, then the commit marker, in this order on disk:

        1. rank 0 marks the directory incomplete and removes any old ``privacy_commit.json`` (so an old marker can
           never vouch for shards overwritten in place), barrier;
        2. every rank writes its ZeRO shards (the ledger rides in ``client_state``);
        3. rank 0 writes ``privacy_ledger.json`` atomically, barrier;
        4. the ranks hash every file of the directory (split between them), rank 0 writes ``privacy_commit.json``
           atomically (ledger run id, head hash and steps, ``global_step``, sizes and SHA-256 of the files) and
           removes the incomplete mark, barrier.

        A process killed anywhere before 4 leaves a directory without a valid marker, which
        :meth:`load_checkpoint` refuses.
        """
        filepath = self.broadcast(filepath)
        directory = Path(filepath)
        if self.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
            _atomic_write_text(directory / INCOMPLETE_FILE, "checkpoint being written; not usable\n")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / COMMIT_FILE)
            _fsync_dir(directory)
        self.barrier("dp_checkpoint_begin")
        if self.ledger is not None:
            checkpoint[LEDGER_KEY] = self.ledger.to_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.ledger is not None and self.is_global_zero:
            self.ledger.save(directory / LEDGER_FILE)
        self.barrier("dp_ledger_saved")
        files = self._hash_checkpoint_files(directory)
        if self.is_global_zero:
            ledger = self.ledger
            commit = {
                "format": COMMIT_FORMAT, "format_version": COMMIT_FORMAT_VERSION,
                "global_step": int(checkpoint.get("global_step", -1)),
                "run_id": ledger.run_id if ledger is not None else None,
                "ledger_head": ledger.head if ledger is not None else None,
                "ledger_steps": ledger.steps if ledger is not None else None,
                "world_size": self.world_size, "zero_stage": self.zero_stage,
                "created_unix": time.time(), "files": files,
            }
            _write_commit(directory, commit)
        self.barrier("dp_checkpoint_committed")

    def _hash_checkpoint_files(self, directory: Path) -> dict[str, dict[str, Any]]:
        """``{relative path: {"size", "sha256"}}`` of every file under ``directory`` (all ranks hash a share)."""
        names = self.broadcast(_checkpoint_files(directory) if self.is_global_zero else None)
        mine = {n: _file_digest(directory / n) for n in names[self.global_rank::self.world_size]}
        return _gather_dicts(mine, self.world_size)

    def remove_checkpoint(self, filepath) -> None:
        # Invalidate first: a deletion killed half-way leaves a directory that load_checkpoint refuses.
        if self.is_global_zero and Path(filepath).is_dir():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(Path(filepath) / COMMIT_FILE)
        super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        """Verify the directory, then let DeepSpeed load it; when fitting, restore and cross-check the ledger.

        Before DeepSpeed unpickles anything: the commit marker must exist and every file must match its size and
        SHA-256 (when fitting; outside fitting a directory without marker loads with a warning unless it was
        left half-written), and every ``.pt`` file must load with ``torch.load(weights_only=True)`` (DeepSpeed
        itself unpickles with ``weights_only=False``). When fitting, the ledger in the client state, the
        ``privacy_ledger.json`` and the marker must all be the same ledger, and cover at least the checkpoint's
        ``global_step``.

        Raises:
            IncompleteCheckpointError: no marker (the save was interrupted, or not written by this strategy).
            CheckpointIntegrityError: the files, the ledgers or the marker disagree.
            UnsafeCheckpointError: a file holds objects that unpickling could execute.
            ValueError: no ledger at all when resuming training.
        """
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        path = Path(checkpoint_path)
        commit = None
        if path.is_dir():
            commit = self._verify_checkpoint_dir(path, required=fitting)
            if not self.trust_checkpoint_pickles:
                self._scan_pickles(path)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if not fitting:
            return checkpoint
        on_disk = path / LEDGER_FILE
        from_state = checkpoint.get(LEDGER_KEY)
        if from_state is None and not on_disk.exists():
            raise ValueError(f"The checkpoint {checkpoint_path} holds no privacy ledger, so the privacy already "
                             "spent is unknown. Resume only from checkpoints written by DPDeepSpeedStrategy, or "
                             "load the weights into a fresh run (new ledger) without ckpt_path.")
        ledger = PrivacyLedger.from_dict(from_state) if from_state is not None else None
        if on_disk.exists():
            disk = PrivacyLedger.load(on_disk)
            if ledger is not None and disk != ledger:
                raise CheckpointIntegrityError(
                    f"{on_disk} and the ledger inside the checkpoint disagree; the checkpoint may have been edited "
                    "or mixed with another run. Refusing to resume.")
            ledger = disk
        global_step = int(checkpoint.get("global_step", 0))
        if commit is not None:
            _check_commit_matches(path, commit, ledger, global_step)
        if ledger.steps < global_step:
            raise CheckpointIntegrityError(
                f"The checkpoint {checkpoint_path} holds weights after {global_step} optimizer steps but its privacy "
                f"ledger charges only {ledger.steps}; the ε it would report is too small. Refusing to resume.")
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

    def _verify_checkpoint_dir(self, directory: Path, required: bool) -> Optional[dict]:
        """Check the commit marker and the files it lists (the ranks share the hashing). Returns the marker."""
        commit = _read_commit(directory, required)
        if commit is None:
            if not required:
                rank_zero_warn(f"{directory} has no {COMMIT_FILE} (not written by DPDeepSpeedStrategy); loading "
                               "it unverified.")
            return None  # when fitting: not written by this strategy; the ledger check names the problem
        names = sorted(commit["files"])
        problems = _file_problems(directory, commit, names[self.global_rank::self.world_size],
                                  check_unlisted=self.is_global_zero)
        _raise_file_problems(directory, _gather_lists(problems, self.world_size))
        return commit

    def _scan_pickles(self, directory: Path) -> None:
        """``torch.load(weights_only=True)`` every ``.pt`` file before DeepSpeed unpickles it fully."""
        names = self.broadcast(sorted(n for n in _checkpoint_files(directory) if n.endswith(".pt"))
                               if self.is_global_zero else None)
        problems = []
        for name in names[self.global_rank::self.world_size]:
            reason = _unsafe_pickle_reason(directory / name)
            if reason:
                problems.append(f"{name}: {reason}")
        problems = _gather_lists(problems, self.world_size)
        if problems:
            raise UnsafeCheckpointError(
                f"The checkpoint {directory} holds objects that loading could execute as code "
                f"({'; '.join(problems[:3])}). Nothing was unpickled. If you wrote this checkpoint yourself and "
                "trust it, set `strategy.trust_checkpoint_pickles = True` before fitting; otherwise do not load it.")

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


# ---------------------------------------------------------------------- checkpoint commit helpers


def _fsync_dir(directory: Path) -> None:
    try:  # make renames and unlinks durable; not possible on every platform
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _atomic_write_text(path: Path, text: str) -> None:
    """Temp file in the same directory, fsync, ``os.replace``, fsync the directory: all or nothing."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _write_commit(directory: Path, commit: dict) -> None:
    """Rank 0, after every other file is on disk: the marker that makes the directory a usable checkpoint."""
    _atomic_write_text(directory / COMMIT_FILE, json.dumps(commit, indent=2, sort_keys=True, allow_nan=False))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / INCOMPLETE_FILE)
    _fsync_dir(directory)


def _checkpoint_files(directory: Path) -> list[str]:
    """Sorted POSIX paths, relative to ``directory``, of the files a commit covers (not the markers, not the
    temp files of atomic writes)."""
    out = []
    for root, _, names in os.walk(directory):
        for name in names:
            if name in (COMMIT_FILE, INCOMPLETE_FILE) or (name.startswith(".") and name.endswith(".tmp")):
                continue
            out.append(Path(root, name).relative_to(directory).as_posix())
    return sorted(out)


def _file_digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _gather_objects(obj: Any, world_size: int) -> list[Any]:
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _gather_dicts(mine: dict, world_size: int) -> dict:
    merged: dict = {}
    for part in _gather_objects(mine, world_size):
        merged.update(part)
    return dict(sorted(merged.items()))


def _gather_lists(mine: list, world_size: int) -> list:
    return [item for part in _gather_objects(mine, world_size) for item in part]


def verify_checkpoint(path) -> dict:
    """Verify a checkpoint directory written by :class:`DPDeepSpeedStrategy` without loading it (one process).

    Returns its ``privacy_commit.json`` (``global_step``, ``ledger_steps``, ``ledger_head``, ``run_id``, ``files``)
    after checking that every file matches its recorded size and SHA-256 and that ``privacy_ledger.json`` is the
    ledger the marker names. Raises :class:`IncompleteCheckpointError` or :class:`CheckpointIntegrityError`.
    """
    directory = Path(path)
    commit = _read_commit(directory, required=True)
    if commit is None:
        raise IncompleteCheckpointError(f"{directory} has no {COMMIT_FILE}: not a complete DPDeepSpeedStrategy "
                                        "checkpoint.")
    _raise_file_problems(directory, _file_problems(directory, commit, sorted(commit["files"]), True))
    if (directory / LEDGER_FILE).exists():
        ledger = PrivacyLedger.load(directory / LEDGER_FILE)
        _check_commit_matches(directory, commit, ledger, commit.get("global_step"))
    return commit


def _read_commit(directory: Path, required: bool) -> Optional[dict]:
    """The parsed marker; None if absent and the directory does not look half-written; raises otherwise."""
    marker = directory / COMMIT_FILE
    if not marker.exists():
        incomplete = (directory / INCOMPLETE_FILE).exists()
        if incomplete or ((directory / LEDGER_FILE).exists() and required):
            raise IncompleteCheckpointError(
                f"The checkpoint {directory} has no {COMMIT_FILE}: "
                + ("its save was interrupted (the process stopped while writing it), so its shards may be missing, "
                   "truncated or a mix of two saves. " if incomplete else
                   "its save did not finish (or it was written before commit markers existed). ")
                + f"Nothing was loaded. Resume from an earlier checkpoint whose directory holds {COMMIT_FILE}, or "
                "start a new run.")
        return None
    try:
        commit = json.loads(marker.read_text(encoding="utf-8"))
        if commit.get("format") != COMMIT_FORMAT or commit.get("format_version") != COMMIT_FORMAT_VERSION:
            raise ValueError(f"not a version-{COMMIT_FORMAT_VERSION} {COMMIT_FORMAT} document")
        if not isinstance(commit["files"], dict):
            raise TypeError("'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointIntegrityError(f"{marker} is unreadable or malformed ({exc}); refusing to load "
                                       f"{directory}.") from exc
    return commit


def _file_problems(directory: Path, commit: dict, names: list[str], check_unlisted: bool) -> list[str]:
    files, problems = commit["files"], []
    for name in names:
        expected = files[name]
        try:
            actual = _file_digest(directory / name)
        except OSError:
            problems.append(f"{name}: missing")
            continue
        if actual != expected:
            problems.append(f"{name}: size/SHA-256 {actual['size']}/{actual['sha256'][:12]}… differ from the "
                            f"commit's {expected.get('size')}/{str(expected.get('sha256'))[:12]}…")
    if check_unlisted:
        problems += [f"{n}: not covered by the commit" for n in _checkpoint_files(directory)
                     if n not in files and n.endswith(".pt")]
    return problems


def _raise_file_problems(directory: Path, problems: list[str]) -> None:
    if problems:
        raise CheckpointIntegrityError(
            f"The checkpoint {directory} does not match its {COMMIT_FILE} ({'; '.join(problems[:5])}"
            f"{' …' if len(problems) > 5 else ''}): files were changed, truncated or replaced after it was "
            "written. Nothing was loaded; resume from another checkpoint.")


def _check_commit_matches(directory: Path, commit: dict, ledger: PrivacyLedger, global_step: int) -> None:
    found = {"run_id": ledger.run_id, "ledger_head": ledger.head, "ledger_steps": ledger.steps,
             "global_step": global_step}
    diffs = [f"{k}: {COMMIT_FILE} says {commit.get(k)!r}, the checkpoint {v!r}" for k, v in found.items()
             if commit.get(k) != v]
    if diffs:
        raise CheckpointIntegrityError(
            f"The checkpoint {directory} disagrees with its {COMMIT_FILE} ({'; '.join(diffs)}): its ledger or "
            "client state belongs to another save or run. Refusing to resume.")


def _safe_globals() -> list:
    """DeepSpeed's own classes in its optimizer-state files, allowed by the ``weights_only`` pre-scan."""
    import importlib

    out = []
    for module, names in (("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
                          ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
                          ("deepspeed.utils.tensor_fragment", ("fragment_address",))):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        out += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return out


def _unsafe_pickle_reason(path: Path) -> Optional[str]:
    """None if ``torch.load(path, weights_only=True)`` succeeds (DeepSpeed's classes allowed), else why not.
    ``mmap`` keeps tensor data unread, so the scan costs little beyond the pickle itself."""
    import pickle

    with torch.serialization.safe_globals(_safe_globals()):
        try:
            try:
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError:
                raise
            except (RuntimeError, ValueError):  # not the zip format, which mmap needs
                torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            import re

            text = str(exc)
            names = sorted(set(re.findall(r"GLOBAL ([\w.]+)", text))) or [text.splitlines()[0][:200] if text else
                                                                           type(exc).__name__]
            return "weights_only refused " + ", ".join(names)[:300]
        except Exception as exc:  # noqa: BLE001 - corrupt or foreign file: refuse, do not unpickle
            return f"unreadable ({type(exc).__name__}: {str(exc)[:200]})"
    return None
