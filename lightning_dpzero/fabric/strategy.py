"""``DPFabricStrategy``: DP-SGD on DeepSpeed ZeRO 0-3 for a training loop written with Lightning Fabric
(docs/fabric.md; docs/design.md, *Where each piece runs*: Fabric).

The same pieces as the Trainer's :class:`~lightning_dpzero.DPDeepSpeedStrategy`, hooked where Fabric calls its
strategy:

* ``fabric.setup(model, optimizer)``: the per-example engine is attached before ``deepspeed.initialize``, the
  mechanism's noise hook on the base optimizer after it; a DeepSpeed config that accumulates or clips
  gradients is refused;
* ``fabric.setup_dataloaders(train_loader)`` (the first loader it sees): the mechanism's private loader
  (distributed Poisson sampler; with ``use_distributed_sampler=False`` over each rank's own shard) and privacy
  plan, the ledger opened;
* the model's training forward: the layout check at the first one, then the micro-batch declared to the engine;
* ``fabric.backward(loss)``: the non-finite check, the loss probe, DeepSpeed's backward;
* ``optimizer.step()``: the ledger charged before the update (I4), the budget and the clipping statistics agreed
  by all ranks after it (``should_stop``, ``privacy_metrics``);
* ``fabric.save`` / ``fabric.load``: :class:`~lightning_dpzero.checkpoints.CheckpointProtocol`.

The order of the loop's calls is checked by :class:`~lightning_dpzero.fabric.loop.FabricSteps`.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy
from torch.utils.data.distributed import DistributedSampler
from typing_extensions import override

from ..lightning import refusals
from ..lightning.settings import DPSettings
from .loop import FabricSteps, announce_draws
from ..lightning.post_processing import PostProcessing, is_post_processing
from ..deepspeed.launch import FabricDeepSpeedLaunchMixin
from ..accounting.background import check_accounting_worker
from ..deepspeed.reduction import deferred_writes_reduced
from ..lightning.strategy_names import register_names
from ..util.options import (Accountant, AccountingWorker, Clipping, ClippingFn, ClippingMode, LayoutCheck,
                            LossReduction, NoiseMechanism, PrivacyUnit, check_loop_bounds, check_option)
from ..checkpoints import CheckpointProtocol
from ..checkpoints.format import LEDGER_KEY
from ..per_sample.layout import reindex_batch
from ..accounting.plan import DEFAULT_DELTA, AccountingSettings

_STEP_KEY = "global_step"  # the optimizer steps of the weights, in the client state (the commit marker's count)
_COUNTER = "Fabric optimizer steps"


class DPFabricStrategy(DPSettings, FabricDeepSpeedLaunchMixin, DeepSpeedStrategy):
    """Fabric's DeepSpeed strategy (ZeRO stages 0–3) with differentially private SGD (Abadi et al. 2016).

    Each ``optimizer.step()`` releases ``(Σ_i clip(g_i) + N(0, σ²C²I)) / B_exp`` over one Poisson-sampled batch
    (``B_exp = q·N``, docs/design.md, *The mechanism*). Takes every argument of Fabric's ``DeepSpeedStrategy``,
    the DP settings of :class:`~lightning_dpzero.DPDeepSpeedStrategy` (``noise_multiplier``, ``max_grad_norm``,
    ``clipping``, ``clipping_fn``, ``gamma``, ``clipping_mode``, ``clipping_groups`` as name patterns, ``group_max_grad_norms``,
    ``poisson_sampling``, ``secure_mode``, ``seed``, ``loss_reduction``, ``layout_check``,
    ``max_micro_batch_size``, ``privacy_unit``, ``max_examples_per_user``, ``noise_mechanism``, ``bands``) and, as
    Fabric has no Trainer or accountant callback:

    Args:
        target_epsilon: ε budget: σ is calibrated to it over the planned steps when ``noise_multiplier`` is
            None; no step is taken that would exceed it (``should_stop``, then :class:`PrivacyBudgetExceeded`).
        delta: δ of the (ε, δ) guarantee (default 1e-5; keep it well below 1/N).
        accountant: ``"pld"`` (default) or ``"rdp"``.
        max_steps: the optimizer steps the loop will run (plans σ); or
        max_epochs: the passes over the training loader it will run (steps = epochs × len(loader)).
        accounting_worker: where rank 0 computes each step's ε and budget answer, ahead of the loop:
            ``"process"`` (default; a child process, so the step does not wait for dp-accounting), ``"thread"``, or
            ``"none"`` (inside ``optimizer.step()``); the values and decisions are the same in all three
            (:mod:`lightning_dpzero.accounting.background`). The worker stops at ``strategy.teardown()`` (and with
            the process).

    ``Fabric(strategy="dp_deepspeed_stage_3")`` gives the defaults (``noise_multiplier=None``, no target): set
    them with :meth:`configure` before ``fabric.setup_dataloaders``.

    Raises:
        ValueError: bad settings (when constructed); a DeepSpeed config with gradient accumulation or clipping.
        UnsupportedLayerError: a trainable layer no per-example rule covers, in ``fabric.setup``.

    Example:
        >>> strategy = DPFabricStrategy(stage=3, max_grad_norm=1.0, target_epsilon=8.0, max_epochs=2)
        >>> strategy.zero_stage, strategy.mechanism.max_grad_norm, strategy.accounting.target_epsilon
        (3, 1.0, 8.0)
    """

    strategy_name = "dp_deepspeed"

    #: as :attr:`DPDeepSpeedStrategy.trust_checkpoint_pickles`: let DeepSpeed unpickle files the pre-scan refuses.
    trust_checkpoint_pickles: bool = False

    def __init__(self, accelerator=None, zero_optimization: bool = True, stage: int = 2,
                 noise_multiplier: Optional[float] = None, max_grad_norm: float = 1.0,
                 clipping: Clipping = "layer-wise", clipping_fn: ClippingFn = "abadi", gamma: float = 0.01,
                 clipping_groups: Optional[list[list[str]]] = None, group_max_grad_norms: Optional[list[float]] = None,
                 poisson_sampling: bool = True, secure_mode: bool = False, seed: Optional[int] = None,
                 loss_reduction: LossReduction = "mean",
                 layout_check: Union[bool, LayoutCheck] = "every-batch",
                 max_micro_batch_size: Optional[int] = None, privacy_unit: PrivacyUnit = "example",
                 max_examples_per_user: Optional[int] = None, noise_mechanism: NoiseMechanism = "dp-sgd",
                 bands: Optional[int] = None, target_epsilon: Optional[float] = None, delta: float = DEFAULT_DELTA, accountant: Accountant = "pld",
                 max_steps: Optional[int] = None, max_epochs: Optional[int] = None,
                 clipping_mode: ClippingMode = "book-keeping", accounting_worker: AccountingWorker = "process",
                 **kwargs: Any) -> None:
        super().__init__(accelerator=accelerator, zero_optimization=zero_optimization, stage=stage, **kwargs)
        if isinstance(clipping_groups, str):
            raise ValueError("clipping_groups='param_groups' is for the Trainer strategy; with Fabric give lists of "
                             "parameter-name patterns, e.g. [['encoder.*'], ['head.*']].")
        self.init_dp_settings(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, clipping=clipping,
                              clipping_fn=clipping_fn, gamma=gamma, clipping_mode=clipping_mode,
                              clipping_groups=clipping_groups,
                              group_max_grad_norms=group_max_grad_norms, poisson_sampling=poisson_sampling,
                              secure_mode=secure_mode, seed=seed, loss_reduction=loss_reduction,
                              layout_check=layout_check, max_micro_batch_size=max_micro_batch_size,
                              privacy_unit=privacy_unit, max_examples_per_user=max_examples_per_user,
                              noise_mechanism=noise_mechanism, bands=bands)
        self.checkpoint_protocol = CheckpointProtocol(self)
        self._loader = None
        self._other_loaders = 0  # loaders set up after the training loader
        self._other_draw: Optional[int] = None  # which of them a batch was drawn from in training mode, since a step
        self._in_layout_check = False
        self.post = PostProcessing()  # models trained by post-processing of the private one (a DP-GAN's generator)
        self.configure(target_epsilon=target_epsilon, delta=delta, accountant=accountant, max_steps=max_steps,
                       max_epochs=max_epochs, accounting_worker=accounting_worker)

    def configure(self, *, target_epsilon: Optional[float] = None,
                  delta: float = DEFAULT_DELTA, accountant: Accountant = "pld", max_steps: Optional[int] = None,
                  max_epochs: Optional[int] = None, accounting_worker: AccountingWorker = "process"
                  ) -> "DPFabricStrategy":
        """The privacy settings (see the class), e.g. after ``Fabric(strategy="dp_deepspeed_stage_3")``; before
        ``fabric.setup_dataloaders``, which fixes the plan (σ is the strategy's ``noise_multiplier``, or calibrated
        to ``target_epsilon`` over ``max_steps`` / ``max_epochs``)."""
        if self.mechanism.plan is not None:
            raise RuntimeError("configure() after fabric.setup_dataloaders: the privacy plan is fixed already. "
                               "Call it before setting up the training loader.")
        self.accounting = AccountingSettings(target_epsilon, delta, check_option("accountant", accountant, Accountant))
        self.mechanism.use_accounting(self.accounting)
        self.max_steps, self.max_epochs = check_loop_bounds(max_steps, max_epochs)
        worker = check_accounting_worker(accounting_worker)
        if getattr(self, "steps", None) is not None:
            self.steps.close()
        self.steps = FabricSteps(self.mechanism, target_epsilon, worker, self.post)
        return self

    # ------------------------------------------------------------------ what the loop reads
    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the DeepSpeed config (0–3)."""
        return int((self.config or {}).get("zero_optimization", {}).get("stage", 0) or 0)

    @property
    def ledger(self):
        """The run's :class:`PrivacyLedger` (None before ``fabric.setup_dataloaders``)."""
        return self.mechanism.ledger

    @property
    def plan(self):
        """The run's :class:`PrivacyPlan` (q, σ, δ, N, B_exp, planned steps)."""
        return self.mechanism.plan

    @property
    def stand_in_batch(self) -> bool:
        """True while the step's batch drawn from the loader was empty (Poisson sampling can draw none): the loop
        got a one-row stand-in for it instead, which any model can run (a Hugging Face attention cannot run zero
        rows) and of which the step takes no example (its loss becomes 0, its gradient is left out). Skip your
        own per-example metrics for it."""
        return self.steps.stand_in_rows > 0

    @property
    def should_stop(self) -> bool:
        """True when one more optimizer step would make ε exceed ``target_epsilon`` (every rank alike): end the
        loop. A step taken anyway is refused with :class:`PrivacyBudgetExceeded` at its forward."""
        return not self.steps.next_step_allowed

    @property
    def privacy_metrics(self) -> dict[str, float]:
        """After each step, the same on every rank: ``epsilon`` (an upper bound within ~2% of the exact value),
        ``delta``, ``noise_multiplier``, ``sample_rate``, ``dp_steps``, and over all ranks' examples of the step
        ``clip_fraction`` and ``mean_grad_norm``: for ``fabric.log_dict(fabric.strategy.privacy_metrics)``."""
        return dict(self.steps.metrics)

    def epsilon(self) -> float:
        """ε spent so far at δ (exact, by the accountant; 0.0 before the first step, ``inf`` with σ = 0)."""
        return self.steps.epsilon(exact=True)

    def reduce(self, tensor: torch.Tensor, group: Optional[Any] = None, reduce_op: Optional[str] = "mean"
               ) -> torch.Tensor:
        """Fabric's ``all_reduce`` under the name the DP pieces use (:class:`~lightning_dpzero.util.collectives.
        Collectives`)."""
        return self.all_reduce(tensor, group=group, reduce_op=reduce_op)

    # ------------------------------------------------------------------ setup
    @override
    def _format_config(self) -> None:
        super()._format_config()
        # DeepSpeed's default is gradient_clipping=1.0, which ZeRO 1-3 apply to the summed gradient inside the
        # optimizer step (the Trainer's strategy sets 0.0; Fabric's leaves DeepSpeed's default): per-example
        # clipping replaces it, and a value the user set is refused in setup
        self.config.setdefault("gradient_clipping", 0.0)

    @override
    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        if is_post_processing(module):  # a generator: DeepSpeed as without DP, its steps not charged
            engine, optimizers, scheduler = super().setup_module_and_optimizers(module, optimizers, scheduler)
            self.post.add(engine, module)
            return engine, optimizers, scheduler
        if self.per_sample is not None:
            raise ValueError(
                "fabric.setup of a second model under DP: one model is trained privately (its steps clipped, noised "
                "and charged). A model trained only through the private one's released parameters on generated "
                "data (a DP-GAN's generator) is post-processing: fabric.setup(post_processing(generator), "
                "optimizer); otherwise put both models in one module (docs/how-to/dp-gan.md).")
        if self.config and self.config.get("gradient_clipping"):
            raise ValueError(
                f"The DeepSpeed config sets gradient_clipping={self.config['gradient_clipping']}; per-example "
                "clipping replaces it. Remove it from the config and set the strategy's max_grad_norm.")
        self.post.engine = self.attach_engine(module, self.clipping_groups, self.zero_stage)
        if self.global_rank == 0:
            self.steps.start_accounting()  # the worker process starts while DeepSpeed initialises
        engine, optimizers, scheduler = super().setup_module_and_optimizers(module, optimizers, scheduler)
        gas = engine.gradient_accumulation_steps()
        if gas != 1:
            raise ValueError(
                f"The DeepSpeed config accumulates gradients (gradient_accumulation_steps={gas}), which the Fabric "
                "DP strategy does not support: each optimizer.step() releases one Poisson-sampled batch of one "
                "forward and backward. Remove gradient_accumulation_steps (and train_batch_size) from the config "
                "and raise the DataLoader's batch_size, or use the Trainer's DPDeepSpeedStrategy with "
                "Trainer(accumulate_grad_batches=...).")
        self.prepare_engine(engine)
        self.mechanism.install_noise(refusals.base_optimizer(engine), replicated=self.zero_stage == 0)
        engine.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        return engine, optimizers, scheduler

    @override
    def setup_module(self, module):
        raise NotImplementedError("DPFabricStrategy trains: set the model up with its optimizer, "
                                  "fabric.setup(model, optimizer).")

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader):
        if not self.mechanism.active:
            raise RuntimeError("fabric.setup_dataloaders before fabric.setup(model, optimizer): the DP strategy "
                               "makes the first loader set up after the model the private training loader. Call "
                               "fabric.setup(model, optimizer) first, then fabric.setup_dataloaders(train_loader).")
        if self._loader is not None:  # loaders after the first (validation): unchanged, their draws followed
            self._other_loaders += 1
            return _draws_followed(super().process_dataloader(dataloader), self, self._other_loaders)
        if self.accounting.target_epsilon is not None and self.mechanism.noise_multiplier is None and not (
                self.max_steps or self.max_epochs):
            raise ValueError("target_epsilon needs the planned length of the loop to calibrate σ: set "
                             "DPFabricStrategy(max_steps=...) or max_epochs=... (or configure(...)), or give "
                             "noise_multiplier (then check fabric.strategy.should_stop after each step).")
        # fabric.setup_dataloaders(use_distributed_sampler=True), the default, gives the loader a DistributedSampler
        # over one global dataset; without one, each rank's loader may hold its own shard (shards.py)
        loader = self.mechanism.private_loader(dataloader, 1, pre_sharded=not isinstance(
            getattr(dataloader, "sampler", None), DistributedSampler))
        self.mechanism.fix_plan(loader, accumulate_grad_batches=1, micro_batches_per_epoch=len(loader),
                                max_steps=self.max_steps, max_epochs=self.max_epochs)
        self._loader = announce_draws(loader, self.steps)
        self.steps.decide(self, self.root_device)
        return self._loader

    # ------------------------------------------------------------------ step
    def _before_forward(self, engine, args, kwargs):
        if self._in_layout_check or not (engine.training and torch.is_grad_enabled()):
            self._other_draw = None  # an evaluation forward, of the other loader's batch if one was drawn
            return None  # evaluation forwards are not DP steps (the engine does not clip them either)
        if self._other_draw is not None:
            raise RuntimeError(
                f"A training forward of the model after a batch was drawn, in training mode, from DataLoader "
                f"#{self._other_draw + 1} set up with fabric.setup_dataloaders: only the first loader set up after "
                "the model is private (Poisson-sampled at the q the ledger charges, its N counted); the others are "
                "left as they are, for evaluation. To train on both datasets, put them in one dataset "
                "(torch.utils.data.ConcatDataset) in the one training loader; to evaluate on another loader, draw "
                "from it with the model in eval mode or under torch.no_grad(). Nothing of this step was applied.")
        steps = self.steps
        which = steps.before_forward(args, kwargs)
        if which != "first":  # "more": the step's sites go on; "public": after the step, without the engine
            return None
        if not steps.fit_started:
            self.mechanism.begin_fit({_COUNTER: steps.taken})
            steps.fit_started = True
        if self.layout_check_due():
            self._in_layout_check, b = True, steps.stand_in_rows or steps.batch_size
            try:
                self.mechanism.check_layout(
                    lambda index: engine(*reindex_batch(args, index, b), **reindex_batch(kwargs, index, b)),
                    b, every_batch=self.spot_checks)
            finally:
                self._in_layout_check = False
        self.per_sample.start_micro_batch(steps.batch_size, steps.stand_in_rows,
                                          units=self.mechanism.units_of(steps.batch_size))
        return None

    @override
    def backward(self, tensor: torch.Tensor, module, *args: Any, **kwargs: Any) -> None:
        if not self.mechanism.active:
            return super().backward(tensor, module, *args, **kwargs)
        if self.post.owns(module):  # a post-processing model's: through the released private model only
            self.per_sample.post_processing_backward = True
            try:
                return super().backward(tensor, module, *args, **kwargs)
            finally:
                self.per_sample.post_processing_backward = False
        self.steps.before_backward()
        engine = self._deepspeed_engine
        loss = self.mechanism.micro_batch_loss(tensor, self.steps.batch_size, step=self.ledger.steps + 1)
        loss = self.mechanism.probe_loss(loss, 1, engine.gradient_accumulation_steps())
        self.post.private_backward = True  # a post-processing model's parameters may receive no gradient in it
        try:
            self.norms_pass(loss)  # two-pass clipping only: the norms (DeepSpeed's backward clips)
            with deferred_writes_reduced(self.per_sample, engine, self.zero_stage, 1):  # no accumulation on Fabric
                return super().backward(loss, module, *args, **kwargs)
        finally:
            self.post.private_backward = False

    @override
    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if not self.mechanism.active or self.post.owns(optimizer):  # a post-processing model's step: no charge
            return super().optimizer_step(optimizer, **kwargs)
        self.steps.before_step(kwargs)
        steps = self.steps
        # Fabric steps DeepSpeed's optimizer itself (not engine.step(), so DeepSpeed's global_steps stays 0): the
        # step counter checked against the ledger is Fabric's own count of optimizer steps
        out = self.mechanism.optimizer_step(
            lambda charged: (charged(), super(DPFabricStrategy, self).optimizer_step(optimizer, **kwargs))[1],
            lambda: None, boundary=True, step_applied=lambda: not getattr(optimizer, "overflow", False),
            counts=lambda: {_COUNTER: steps.taken + 1})
        steps.after_step()
        self._other_draw = None
        steps.decide(self, self.root_device, self.mechanism.take_stats())
        return out

    @override
    def clip_gradients_norm(self, *args: Any, **kwargs: Any):
        raise ValueError("fabric.clip_gradients would clip the *noisy* batch gradient; DP training clips each "
                         "example instead: remove the call and set the strategy's max_grad_norm.")

    @override
    def clip_gradients_value(self, *args: Any, **kwargs: Any):
        self.clip_gradients_norm()

    # ------------------------------------------------------------------ checkpoints (docs/design.md, *Checkpoints*)
    @override
    def save_checkpoint(self, path, state: dict, storage_options: Optional[Any] = None, filter=None) -> None:
        """DeepSpeed's checkpoint with the ledger in its client state, ``privacy_ledger.json``, then the commit
        marker (:meth:`CheckpointProtocol.save`); ``global_step`` in the client state counts the optimizer steps.

        Raises:
            ValueError: ``state`` has a key ``global_step`` or ``privacy_ledger`` (reserved; name yours otherwise).
        """
        reserved = {_STEP_KEY, LEDGER_KEY} & set(state)
        if reserved:
            raise ValueError(f"fabric.save state keys {sorted(reserved)} are reserved by DP checkpoints (the "
                             "optimizer-step count and the privacy ledger); name yours otherwise, e.g. 'step'.")
        checkpoint = {**state, _STEP_KEY: self.steps.taken}
        self.checkpoint_protocol.save(
            checkpoint, path, self.ledger, zero_stage=self.zero_stage,
            write_shards=lambda c, p: super(DPFabricStrategy, self).save_checkpoint(p, c, storage_options, filter),
            noise_state=self.mechanism.noise_state())

    @override
    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: Optional[bool] = None):
        """Verify the directory, let DeepSpeed load it, and (the model being trained) continue its ledger with
        fresh noise and sampling streams. Raises what :meth:`DPDeepSpeedStrategy.load_checkpoint` raises."""
        training = self.mechanism.active
        deepspeed_dir = not isinstance(state, (torch.nn.Module, torch.optim.Optimizer))
        commit = None
        if deepspeed_dir:
            commit = self.checkpoint_protocol.verify(path, required=training, zero_stage=self.zero_stage,
                                                     trust_pickles=self.trust_checkpoint_pickles)
        remainder = super().load_checkpoint(path, state, strict, weights_only)
        if training and deepspeed_dir:
            self.mechanism.resume(self.checkpoint_protocol.loaded_ledger(path, remainder, commit),
                                  self.checkpoint_protocol.noise_state(path))
            self._after_resume(int(remainder.get(_STEP_KEY, 0)))
        if isinstance(remainder, dict):
            for key in (_STEP_KEY, LEDGER_KEY):
                remainder.pop(key, None)
        return remainder

    def _after_resume(self, steps_taken: int) -> None:
        """Continue the step count; if the loader was set up before the load, its plan takes the restored ledger
        and its sampler the renewed seed (never the streams of the fit that wrote the checkpoint)."""
        self.steps.fit_started, self.steps.taken = False, steps_taken
        if self.mechanism.plan is None:
            return
        self.mechanism.use_plan(self.mechanism.plan)
        if not self.mechanism.secure_mode:
            self._loader.batch_sampler.seed = int(self.mechanism.seed)
        self.steps.decide(self, self.root_device)

    @override
    def teardown(self) -> None:
        self.steps.close()
        self.post.close()
        super().teardown()

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        register_names(strategy_registry, cls)


def _followed_iter(loader):
    strategy = loader._dp_strategy
    for batch in super(type(loader), loader).__iter__():
        engine = strategy._deepspeed_engine
        if engine is not None and engine.training and torch.is_grad_enabled():
            strategy._other_draw = loader._dp_index  # a training forward next would train on it: refused
        yield batch


def _draws_followed(loader, strategy: DPFabricStrategy, index: int):
    """``loader`` itself (a loader set up after the training loader), its class extended so that a batch drawn
    from it while the model is in training mode with gradients on is noted: a training forward on it would train
    on examples the ledger does not charge (as ``_fabric_loop.announce_draws`` extends the training loader)."""
    if not hasattr(loader, "_dp_index"):  # (a loader set up twice is extended once)
        loader.__class__ = type(f"Followed{type(loader).__name__}", (type(loader),), {"__iter__": _followed_iter})
    loader._dp_strategy, loader._dp_index = strategy, index
    return loader


DPFabricStrategy.register_strategies(STRATEGY_REGISTRY)  # the names now stand for the class (lightning/registration.py)
