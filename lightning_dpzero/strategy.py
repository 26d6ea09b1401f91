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
  ``privacy_ledger.json`` beside the ZeRO shards.
"""

from __future__ import annotations

import contextlib
import math
import secrets
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
        if noise_multiplier is not None and not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier (σ) must be >= 0, got {noise_multiplier!r}.")
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
            return super().training_step(*args, **kwargs)
        # An empty Poisson batch is a valid noise-only step that every rank must run (collectives). The mean
        # loss over no examples is NaN: its self.log calls are dropped, so no epoch mean turns NaN, and the
        # loss handed to backward is 0 (its gradient is exactly zero either way).
        with _logging_suppressed(self.lightning_module):
            out = super().training_step(*args, **kwargs)
        return _zero_loss(out)

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

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if self.ledger is not None:
            checkpoint[LEDGER_KEY] = self.ledger.to_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)
        filepath = self.broadcast(filepath)
        if self.ledger is not None and self.is_global_zero:
            self.ledger.save(Path(filepath) / LEDGER_FILE)
        self.barrier("dp_ledger_saved")

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        trainer = self.lightning_module.trainer
        if trainer.state.fn != TrainerFn.FITTING:
            return checkpoint
        on_disk = Path(checkpoint_path) / LEDGER_FILE
        from_state = checkpoint.get(LEDGER_KEY)
        if from_state is None and not on_disk.exists():
            raise ValueError(f"The checkpoint {checkpoint_path} holds no privacy ledger, so the privacy already "
                             "spent is unknown. Resume only from checkpoints written by DPDeepSpeedStrategy, or "
                             "load the weights into a fresh run (new ledger) without ckpt_path.")
        ledger = PrivacyLedger.from_dict(from_state) if from_state is not None else None
        if on_disk.exists():
            disk = PrivacyLedger.load(on_disk)
            if ledger is not None and disk != ledger:
                raise ValueError(f"{on_disk} and the ledger inside the checkpoint disagree; the checkpoint may "
                                 "have been edited or mixed with another run. Refusing to resume.")
            ledger = disk
        self._restored_ledger = ledger
        return checkpoint

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
