"""``DPDeepSpeedStrategy``: Lightning's DeepSpeed strategy with DP-SGD; Lightning and DeepSpeed hooks that call
the DP pieces (docs/design.md, *Where each piece runs*).

* ``setup``: validate settings, trainer and module (I5), attach the per-example engine, then DeepSpeed as usual,
  then the mechanism's noise hook on the base optimizer;
* ``process_dataloader``: the mechanism's private loader (Poisson sampler, also of per-rank shards) and plan;
* ``training_step`` / ``backward``: the mechanism declares each micro-batch and probes the loss for every factor
  Lightning and DeepSpeed put on it, so the engine recovers each example's own gradient before clipping;
* ``on_train_batch_start`` / ``optimizer_step``: DeepSpeed's boundary follows the sampler's window, and the ledger
  is charged at each boundary before the update, the step counters checked (``loop.py``: also SIGTERM);
* ``save_checkpoint`` / ``load_checkpoint`` / ``remove_checkpoint``: ``CheckpointProtocol`` (checkpoints/).

The DP step itself is :class:`~lightning_dpzero.mechanism.DPMechanism` (``strategy.mechanism``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

from ..checkpoints import CheckpointProtocol
from ..deepspeed.launch import DeepSpeedLaunchMixin
from ..deepspeed.reduction import deferred_writes_reduced
from ..per_sample.layout import reindex_batch
from ..util import known_warnings
from ..util.options import Clipping, ClippingFn, ClippingMode, LayoutCheck, LossReduction, NoiseMechanism, PrivacyUnit
from . import loop as _loop, refusals
from .manual_loop import ManualSteps, one_optimizer
from .settings import DPSettings, OfMechanism
from .strategy_names import register_names


class DPDeepSpeedStrategy(DPSettings, DeepSpeedLaunchMixin, DeepSpeedStrategy):
    """DeepSpeed ZeRO (stages 0–3) with differentially private SGD (Abadi et al. 2016; Bu et al., DP-ZeRO).

    The released gradient of each optimizer step is ``(Σ_i clip(g_i) + N(0, σ²C²I)) / B_exp`` with
    ``B_exp = q·N`` (docs/design.md, *The mechanism*). Takes every argument of Lightning's
    ``DeepSpeedStrategy`` plus:

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
        clipping_mode: for all-layer and group-wise clipping: ``"book-keeping"`` (default; one backward pass,
            which keeps every layer's input and output gradient until its last layer has run) or ``"two-pass"``
            (a first backward pass takes the per-example norms, DeepSpeed's backward then forms the clipped
            gradients: the peak memory of non-private training, for the time of one more backward pass of the
            layers' input gradients; not with fp16). Layer-wise clipping refuses ``"two-pass"``.
        gamma: γ of ``"automatic"`` clipping (default 0.01).
        poisson_sampling: Poisson-sample logical batches (default). ``False``: shuffled fixed-size batches,
            accounted as if Poisson with q = B·W·K/N (a common approximation; the ledger records it).
        secure_mode: noise and sampling from OS entropy; nothing can reproduce them.
        seed: seed of noise and sampling when not in secure mode; ``None`` draws one from OS entropy.
        loss_reduction: ``"mean"`` (``training_step`` returns the mean of per-example losses) or ``"sum"``.
        max_micro_batch_size: b, the most examples one micro-batch may hold on a device (None: unbounded); larger
            Poisson draws are cut, at a cost in δ the ledger charges (docs/privacy.md, *Bounded micro-batches*).
        privacy_unit: ``"example"`` (default) or ``"user"``: user-level DP over the dataset's ``user_ids``, each
            sampled user contributing ``max_examples_per_user`` (k) rows; ε is per user
            (docs/how-to/user-level-dp.md).
        noise_mechanism: ``"dp-sgd"`` (default); ``"banded-mf"`` (noise correlated over b steps) or ``"blt"`` (over
            the whole run, not amplified), each with cyclic sampling over ``bands`` = b fixed parts (docs/how-to/correlated-noise.md).
        layout_check: ``"every-batch"`` (default): prove that layer inputs and loss are per example at the first
            micro-batch, then spot-check each later one (docs/reliability.md). ``"first-batch"``, ``"off"``.

    Raises:
        ValueError: bad settings, when constructed (a YAML config with a bad string option fails when parsed).
        UnsupportedLayerError: a trainable layer no per-example rule covers, before the first step.

    Example:
        >>> strategy = DPDeepSpeedStrategy(stage=3, noise_multiplier=1.1, max_grad_norm=1.0, clipping="all-layer")
        >>> strategy.noise_multiplier, strategy.mechanism.max_grad_norm, strategy.zero_stage
        (1.1, 1.0, 3)
    """

    strategy_name = "dp_deepspeed"

    #: Let DeepSpeed unpickle checkpoint files that the ``weights_only`` pre-scan refuses (objects other than
    #: tensors, containers, numbers, strings and DeepSpeed's own loss-scaler/stage classes). Unpickling can run
    #: arbitrary code: set it only for checkpoints you wrote yourself.
    trust_checkpoint_pickles: bool = False

    def __init__(self, accelerator=None, zero_optimization: bool = True, stage: int = 2,
                 noise_multiplier: Optional[float] = None, max_grad_norm: float = 1.0,
                 clipping: Clipping = "layer-wise", clipping_fn: ClippingFn = "abadi", gamma: float = 0.01,
                 clipping_groups: Optional[Union[Literal["param_groups"], list[list[str]]]] = None,
                 group_max_grad_norms: Optional[list[float]] = None,
                 poisson_sampling: bool = True, secure_mode: bool = False, seed: Optional[int] = None,
                 loss_reduction: LossReduction = "mean", layout_check: Union[bool, LayoutCheck] = "every-batch",
                 max_micro_batch_size: Optional[int] = None, clipping_mode: ClippingMode = "book-keeping",
                 privacy_unit: PrivacyUnit = "example", max_examples_per_user: Optional[int] = None,
                 noise_mechanism: NoiseMechanism = "dp-sgd", bands: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(accelerator=accelerator, zero_optimization=zero_optimization, stage=stage, **kwargs)
        self.init_dp_settings(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, clipping=clipping,
                              clipping_fn=clipping_fn, gamma=gamma, clipping_mode=clipping_mode,
                              clipping_groups=clipping_groups,
                              group_max_grad_norms=group_max_grad_norms, poisson_sampling=poisson_sampling,
                              secure_mode=secure_mode, seed=seed, loss_reduction=loss_reduction,
                              layout_check=layout_check, max_micro_batch_size=max_micro_batch_size,
                              privacy_unit=privacy_unit, max_examples_per_user=max_examples_per_user,
                              noise_mechanism=noise_mechanism, bands=bands)
        self._fit_loop = _loop.FitLoopGuard(self.mechanism)
        self.checkpoint_protocol = CheckpointProtocol(self)
        self._private_loader: Any = None  # the training loader process_dataloader built (an empty batch's stand-in)
        self._manual = ManualSteps()  # automatic_optimization=False: the calls of each training_step (_manual_loop)

    # ------------------------------------------------------------------ the mechanism's settings and state
    noise_multiplier = OfMechanism()
    """σ: the plan's once it is fixed (calibrated from a target ε, or as given), before that as given."""
    max_grad_norm = OfMechanism()  #: C
    seed = OfMechanism()  #: seed of the noise and sampling streams (drawn at setup if not given; renewed on resume)
    secure_mode, poisson_sampling, max_micro_batch_size = OfMechanism(), OfMechanism(), OfMechanism()
    privacy_unit, noise_mechanism = OfMechanism(), OfMechanism()
    plan = OfMechanism()
    """The run's :class:`PrivacyPlan` (q, σ, δ, N, B_exp, planned steps), fixed with the training loader."""
    ledger = OfMechanism()
    """The run's :class:`PrivacyLedger`, opened with the plan (or restored from the checkpoint)."""

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the DeepSpeed config (0–3)."""
        return int((self.config or {}).get("zero_optimization", {}).get("stage", 0) or 0)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer) -> None:
        known_warnings.filter_known_warnings()  # every rank: DeepSpeed's deprecated calls warn at every step
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            refusals.check_trainer(trainer, self.config)
            self._fit_loop.install(trainer)  # before Lightning registers its SIGTERM handler (after setup)
            self._manual = ManualSteps(enabled=not trainer.lightning_module.automatic_optimization)
            patterns = None if self.clipping_groups == "param_groups" else self.clipping_groups
            self.attach_engine(self.model, patterns, self.zero_stage)
        super().setup(trainer)
        if fitting:
            if self.clipping_groups == "param_groups":
                self.per_sample.set_groups(self._user_param_groups, self.group_max_grad_norms)
            self.prepare_engine(self.deepspeed_engine)
            self.mechanism.install_noise(refusals.base_optimizer(self.deepspeed_engine),
                                         replicated=self.zero_stage == 0)

    @override
    def _init_optimizers(self):
        optimizer, scheduler = one_optimizer(super()._init_optimizers)  # several: what DP can do instead
        # DeepSpeed replaces param_groups by flat partitions; keep the user's grouping for group-wise clipping.
        self._user_param_groups = [list(g["params"]) for g in optimizer.param_groups]
        return optimizer, scheduler

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or not self.mechanism.active:
            return super().process_dataloader(dataloader)
        k, sharded = trainer.accumulate_grad_batches, not trainer._accelerator_connector.use_distributed_sampler
        loader = self._private_loader = self.mechanism.private_loader(dataloader, k, pre_sharded=sharded)
        per_epoch = refusals.micro_batches_per_epoch(dataloader, loader, trainer)
        self.mechanism.fix_plan(loader, accumulate_grad_batches=k, max_steps=trainer.max_steps,
                                max_epochs=trainer.max_epochs, micro_batches_per_epoch=per_epoch)
        return loader

    # ------------------------------------------------------------------ step (accumulation windows: _lightning_loop)
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.mechanism.active:
            self._fit_loop.before_micro_batch(self.deepspeed_engine)

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        if not self.mechanism.active:
            return super().training_step(*args, **kwargs)
        batch_size = extract_batch_size(args[0]) if args else None
        self._manual.start(batch_size)
        if batch_size == 0:  # an empty batch: on its one-row stand-in (_lightning_loop.empty_batch_step)
            out = _loop.empty_batch_step(self, args, lambda a, rows: self._training_step(a, kwargs, 0, rows))
        else:
            out = self._training_step(args, kwargs, batch_size, batch_size)
        self._manual.end()
        self._fit_loop.after_micro_batch()
        return out

    def _training_step(self, args: tuple, kwargs: dict, batch_size: Optional[int], rows: Optional[int]):
        """The micro-batch's step (and layout check) through the mechanism; ``rows``: those ``args[0]`` holds."""
        def run(batch_args=args):
            with refusals.explain_released_parameters(self.zero_stage):
                return super(DPDeepSpeedStrategy, self).training_step(*batch_args, **kwargs)

        trainer = self.lightning_module.trainer
        if args and self.layout_check_due():  # before this micro-batch's update
            with self._manual.inert(trainer):
                self.mechanism.check_layout(lambda i: run((reindex_batch(args[0], i, rows), *args[1:])), rows,
                                            module=self.lightning_module, every_batch=self.spot_checks)
        return self.mechanism.training_step(run, batch_size, module=self.lightning_module,
                                            step=trainer.global_step + 1, epoch=trainer.current_epoch,
                                            stand_in_rows=rows if batch_size == 0 else 0,
                                            loss_in_backward=self._manual.enabled)

    @property
    def stand_in_batch(self) -> bool:
        """True from the start of a micro-batch drawn empty to the next: its step runs on a one-row stand-in
        that adds nothing to the update (docs/design.md); keep it out of metric objects updated in the step."""
        return bool(self.per_sample is not None and self.per_sample.stand_in)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.mechanism.active:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        closure_loss = self._manual.backward_loss(self, closure_loss)  # manual optimization: once per batch
        if closure_loss is None:  # manual optimization, inside the layout check's re-run: no backward
            return None
        k, engine = self.lightning_module.trainer.accumulate_grad_batches, self.deepspeed_engine
        closure_loss = self.mechanism.probe_loss(closure_loss, k, engine.gradient_accumulation_steps())
        with self._manual.backward_context(engine):
            self.norms_pass(closure_loss)  # two-pass clipping only: the norms (DeepSpeed's backward clips)
            with deferred_writes_reduced(self.per_sample, engine, self.zero_stage, k):
                return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any):
        if not self.mechanism.active or self.mechanism.plan is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        engine, trainer = self.deepspeed_engine, self.lightning_module.trainer
        if self._manual.is_inert:  # manual optimization, inside the layout check's re-run: no step
            return closure()
        closure = self._manual.checked(closure)  # manual optimization: once per batch, after its one backward
        return self.mechanism.optimizer_step(
            lambda charged_closure: super(DPDeepSpeedStrategy, self).optimizer_step(optimizer, charged_closure,
                                                                                    model, **kwargs),
            closure, boundary=engine.is_gradient_accumulation_boundary(), step_applied=engine.was_step_applied,
            counts=lambda: _loop.step_counters(trainer, engine, with_this_update=True))

    # ------------------------------------------------------------------ checkpoints (docs/design.md, *Checkpoints*)
    @override
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """DeepSpeed's checkpoint, the ledger twice, then the commit marker: :meth:`CheckpointProtocol.save`."""
        self.checkpoint_protocol.save(checkpoint, filepath, self.ledger, zero_stage=self.zero_stage,
            write_shards=lambda c, path: super(DPDeepSpeedStrategy, self).save_checkpoint(c, path, storage_options),
            noise_state=self.mechanism.noise_state())

    @override
    def remove_checkpoint(self, filepath) -> None:
        self.checkpoint_protocol.invalidate(filepath)
        super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        """Verify the directory, then let DeepSpeed load it; when fitting, continue its ledger with fresh noise
        and sampling streams (:meth:`CheckpointProtocol.verify` and :meth:`CheckpointProtocol.loaded_ledger`).

        Raises:
            IncompleteCheckpointError: no marker (the save was interrupted, or not written by this strategy).
            CheckpointIntegrityError: the files, the ledgers or the marker disagree.
            UnsafeCheckpointError: a file holds objects that unpickling could execute.
            ValueError: no ledger at all when resuming training; ZeRO shards of another number of processes.
        """
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        commit = self.checkpoint_protocol.verify(checkpoint_path, required=fitting, zero_stage=self.zero_stage,
                                                 trust_pickles=self.trust_checkpoint_pickles)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if fitting:
            self.mechanism.resume(self.checkpoint_protocol.loaded_ledger(checkpoint_path, checkpoint, commit),
                                  self.checkpoint_protocol.noise_state(checkpoint_path))
        return checkpoint

    # ------------------------------------------------------------------ errors and teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        module = self.lightning_module
        refusals.explain_missing_len(exception, module is not None and module._trainer is not None
                                      and module.trainer.training)

    @override
    def teardown(self) -> None:
        self.mechanism.detach()
        self._fit_loop.uninstall()
        super().teardown()

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        register_names(strategy_registry, cls)


DPDeepSpeedStrategy.register_strategies(StrategyRegistry)  # the names now stand for the class (registration.py)
