"""One DP-SGD step, owned by one object (docs/design.md, *The mechanism* and *Where each piece runs*).

:class:`DPMechanism` holds everything that makes an optimizer step private and nothing about what drives the
training loop: the privacy plan, the ledger (opened, restored, charged before the update, I4), the factors on
the loss (the loss probe, *The factors on the loss*), the noise hook and its scales (I3), the non-finite-loss
policy, empty Poisson batches, fresh random streams after a resume, and the check that the noise ran before an
update was applied. It talks to the other ranks through :class:`~lightning_dpzero.util.collectives.Collectives`,
which every Lightning strategy is, so the same object serves the Trainer's :class:`DPDeepSpeedStrategy`, a
Fabric loop, or a loop in plain PyTorch (the audit).

A driver calls, in this order:

1. :meth:`attach` once the per-example engine is attached to the module, at every fit (draws a seed shared by
   the ranks; a fit that continues the ledger derives its streams' seed from the ledger's position);
2. :meth:`install_noise` on the optimizer whose ``step`` receives the reduced gradient;
3. :meth:`private_loader` and :meth:`fix_plan` once the training loader is known (or :meth:`use_plan`
   with a plan of its own); the ledger is opened there, or the restored one continued;
4. optionally :meth:`begin_fit` with the driver's step counters before the first update;
5. per micro-batch, :meth:`training_step` around the forward (its all-reduce also carries a stop that
   :meth:`request_stop` asked for: :attr:`stop_agreed`) and :meth:`probe_loss` on the loss before backward;
6. per optimizer step, :meth:`optimizer_step` around the step;
7. :meth:`resume` when a checkpoint is loaded (:meth:`restore_ledger` for another copy of its ledger).

The accountant callback hands its settings over with :meth:`use_accounting` and reads :attr:`plan`,
:attr:`ledger` and :meth:`take_stats`.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
from torch.utils.data import DataLoader

from .util.collectives import Collectives, SingleProcess, sum_over_ranks
from .sampling.micro_batch import logging_suppressed, non_finite_loss_message, without_rows, zero_loss
from .accounting.step_counts import ChargedUpdates, StepCounts
from .accounting import PrivacyLedger
from .accounting.truncation import check_max_micro_batch_size
from .noise import NoiseSource, StreamSeeds, make_noise_pre_hook, warn_explicit_seed
from .banded_mf import CorrelatedNoise, check_banded_supported
from .per_sample import PerSampleEngine
from .accounting.plan import AccountingSettings, PrivacyPlan
from .sampling.shards import describe_training_data, private_training_loader
from .sampling.users import check_privacy_unit, unit_text, user_level_loader


class NonFiniteLossError(RuntimeError):
    """``training_step`` returned a NaN or infinite loss; training stops with that step charged to the ledger."""


class StepStats(NamedTuple):
    """The clipping statistics of this rank since the last :meth:`DPMechanism.take_stats`."""

    examples: int    #: examples whose per-example norms were taken
    clipped: int     #: of those, the examples whose total norm exceeded C (scaled down)
    norm_sum: float  #: sum of their total per-example norms (before clipping)


class _LossProbe(torch.autograd.Function):
    """Identity on the loss whose backward reports d(final scaled loss)/d(loss) to the mechanism."""

    @staticmethod
    def forward(ctx, loss, mechanism, accumulate_grad_batches, gradient_accumulation_steps):
        ctx.mechanism, ctx.k, ctx.gas = mechanism, accumulate_grad_batches, gradient_accumulation_steps
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.mechanism._on_loss_grad(g, ctx.k, ctx.gas)
        return g, None, None, None


class DPMechanism:
    """The DP-SGD step of a run: ``g̃ = (Σ_i clip(g_i) + N(0, σ²C²I)) / B_exp`` with ``B_exp = q·N``.

    Args:
        noise_multiplier: σ >= 0; ``None`` until the plan calibrates it from a target ε.
        max_grad_norm: C, the bound on each example's gradient norm (``math.inf`` only with σ = 0).
        seed: seed of the noise and sampling streams (not in secure mode); ``None``: OS entropy at every fit and load.
        secure_mode: noise and sampling from OS entropy; nothing can reproduce them.
        poisson_sampling: Poisson-sampled logical batches (default); ``False``: shuffled fixed-size batches.
        max_micro_batch_size: b, the most examples one micro-batch may hold (None: unbounded): larger Poisson
            draws are truncated, at a cost in δ the plan and the ledger account (docs/privacy.md, *Bounded
            micro-batches*).
        privacy_unit, max_examples_per_user: user-level DP (docs/how-to/user-level-dp.md).
        noise_mechanism, bands: ``"dp-sgd"`` (default) or ``"banded-mf"`` with b bands: correlated noise over
            cyclic Poisson sampling (:class:`~lightning_dpzero.banded_mf.CorrelatedNoise`,
            docs/how-to/correlated-noise.md).

    Raises:
        ValueError: σ negative or not finite; σ > 0 with C = inf; b not an integer >= 1; what
            :class:`~lightning_dpzero.banded_mf.CorrelatedNoise` refuses.

    Example:
        One private step in plain PyTorch (what the strategy does inside Lightning and DeepSpeed):

        >>> import torch
        >>> from torch import nn
        >>> from lightning_dpzero import PerSampleEngine
        >>> from lightning_dpzero.accounting.plan import PrivacyPlan
        >>> model = nn.Linear(4, 2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> mechanism = DPMechanism(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
        >>> mechanism.attach(PerSampleEngine(model, max_grad_norm=1.0).attach())
        >>> mechanism.install_noise(optimizer, replicated=True)
        >>> mechanism.use_plan(PrivacyPlan(dataset_size=100, sample_rate=0.08, expected_batch_size=8.0,
        ...                                noise_multiplier=1.0, delta=1e-5, planned_steps=1, sampler_kind="poisson"))
        >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        >>> def closure():  # forward and backward of one micro-batch: per-example clipping
        ...     loss = mechanism.training_step(lambda: nn.functional.cross_entropy(model(x), y), batch_size=8)
        ...     mechanism.probe_loss(loss).backward()
        >>> def step(charged_closure):
        ...     charged_closure()   # the closure, then the ledger charge
        ...     optimizer.step()    # the noise hook runs first: (Σ clip(g_i) + σ·C·z) / B_exp
        >>> mechanism.optimizer_step(step, closure, boundary=True, step_applied=lambda: True)
        >>> mechanism.ledger.steps, mechanism.take_stats().examples
        (1, 8)
    """

    def __init__(self, noise_multiplier: Optional[float] = None, max_grad_norm: float = 1.0, *,
                 seed: Optional[int] = None, secure_mode: bool = False, poisson_sampling: bool = True,
                 max_micro_batch_size: Optional[int] = None, privacy_unit: str = "example",
                 max_examples_per_user: Optional[int] = None, noise_mechanism: str = "dp-sgd",
                 bands: Optional[int] = None) -> None:
        self.privacy_unit, self.max_examples_per_user = check_privacy_unit(privacy_unit, max_examples_per_user)
        self.correlated = CorrelatedNoise(noise_mechanism, bands, poisson_sampling=poisson_sampling,
                                          privacy_unit=self.privacy_unit, max_micro_batch_size=max_micro_batch_size)
        self.noise_mechanism, self.bands = self.correlated.noise_mechanism, self.correlated.bands
        self._user_sampler = None  # privacy_unit="user": the training loader's sampler, which knows each row's user
        self._loader_sampler = None  # BandMF: the cyclic sampler, which knows each micro-batch's step
        if noise_multiplier is not None and not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"noise_multiplier (σ) must be >= 0 and finite, got {noise_multiplier!r}.")
        if noise_multiplier and math.isinf(max_grad_norm):
            raise ValueError("max_grad_norm=inf with noise_multiplier > 0 would add infinite noise; set a finite C.")
        self._noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.seed, self.secure_mode, self.poisson_sampling = seed, secure_mode, poisson_sampling
        self.max_micro_batch_size = check_max_micro_batch_size(max_micro_batch_size)
        self._seeds = StreamSeeds(seed)  # the seed given, or one drawn from OS entropy at every fit
        self.accounting = AccountingSettings()
        self.plan: Optional[PrivacyPlan] = None      #: fixed by fix_plan / use_plan
        self.ledger: Optional[PrivacyLedger] = None  #: opened with the plan
        self.engine: Optional[PerSampleEngine] = None
        self.collectives: Collectives = SingleProcess()
        self._restored: Optional[PrivacyLedger] = None
        self._noise_target: Optional[tuple[torch.optim.Optimizer, bool]] = None
        self._noise_handle = None
        self._noise_applied = False
        self._updates = ChargedUpdates()  # the noised optimizer updates only inside a charged step, each parameter once
        self._stop_requested = False  # this rank's: a SIGTERM arrived (set by a signal handler, no collective)
        self.stop_agreed = False      #: every rank knows some rank was asked to stop (after the same micro-batch)
        self._counts = StepCounts()
        #: called with the factor on each loss after the probe (its gradient × the accumulation steps): a driver's
        #: check that the loss scale it divides out was put on the loss (DeepSpeed's fp16, ``_dp_settings``)
        self.loss_factor_check: Optional[Callable[[float], None]] = None
        #: the driver multiplies each loss by a dynamic fp16 loss scale (DeepSpeed's fp16): an infinite loss gradient
        #: is then that scale's overflow, which the driver skips the step for, not a loss to refuse
        self.loss_scaled_fp16 = False

    @property
    def noise_multiplier(self) -> Optional[float]:
        """σ of the plan once it is fixed (calibrated or given), before that the σ given (None: to calibrate)."""
        return self.plan.noise_multiplier if self.plan is not None else self._noise_multiplier

    @property
    def active(self) -> bool:
        """Whether an engine is attached (training); the driver then routes its steps through the mechanism."""
        return self.engine is not None

    # ------------------------------------------------------------------------------------------ setup
    def use_accounting(self, settings: AccountingSettings) -> None:
        """δ, the accountant and the target ε of the run (from :class:`PrivacyAccountantCallback`); without a
        call the defaults of :class:`AccountingSettings` hold."""
        self.accounting = settings

    def attach(self, engine: PerSampleEngine, collectives: Optional[Collectives] = None) -> None:
        """Use ``engine`` (attached to the module) and ``collectives`` (the run's ranks; default one process).
        Without a seed (and not in secure mode too, for the sampler) a new one is drawn from OS entropy, the same on
        every rank: stage 0's shared noise stream needs it."""
        self.engine = engine
        self.collectives = collectives if collectives is not None else SingleProcess()
        self._stop_requested = self.stop_agreed = False
        self._renew_seed()
        if self._seeds.given is not None and not self.secure_mode:
            warn_explicit_seed()
        # a fit that continues a ledger (a second fit of the same Trainer) must not replay the streams of any
        # earlier fit: a fresh seed per fit, or (explicit seed) one derived from the position and the fit number
        self.seed = self.stream_seed(self.ledger)

    def detach(self) -> None:
        """Give the module its own forwards back (end of fit)."""
        if self.engine is not None:
            self.engine.detach()

    def install_noise(self, optimizer: torch.optim.Optimizer, *, replicated: bool) -> None:
        """Register the noise as a step pre-hook on ``optimizer`` (docs/design.md, *Where each piece runs*:
        step). ``replicated``: every rank holds the whole gradient (ZeRO stage 0) and draws the same noise."""
        self._noise_target = (optimizer, replicated)
        source = self.correlated.wrap(NoiseSource(self.seed, self.secure_mode, replicated=replicated,
                                                  rank=self.collectives.global_rank))
        self._noise_handle = optimizer.register_step_pre_hook(
            make_noise_pre_hook(self.noise_scales, source, self._mark_noise_applied, self._updates.check))

    def noise_scales(self) -> tuple[float, float]:
        """``(W / B_exp, σ·C / B_exp)``: the factor on this rank's reduced gradient (DeepSpeed averaged it over
        the W ranks) and the standard deviation of the noise per coordinate."""
        assert self.plan is not None
        b_exp = self.plan.expected_batch_size
        sigma = self.plan.noise_multiplier
        std = sigma * self.max_grad_norm / b_exp if sigma > 0 else 0.0
        return self.collectives.world_size / b_exp, std

    def _mark_noise_applied(self) -> None:
        self._noise_applied = True

    # ------------------------------------------------------------------------------------------ data and plan
    def private_loader(self, dataloader: DataLoader, accumulate_grad_batches: int, pre_sharded: bool = False
                       ) -> DataLoader:
        """The training loader over the same dataset with the distributed Poisson (or shuffled) sampler at
        ``q = B·W·K/N`` (:func:`lightning_dpzero.sampling.shards.private_training_loader`, which lists what it raises)."""
        options = dict(pre_sharded=pre_sharded, poisson=self.poisson_sampling, seed=self.seed,
                       secure_mode=self.secure_mode, max_micro_batch_size=self.max_micro_batch_size)
        self._loader_sampler = None
        if self.correlated.cyclic:  # BandMF: the parts are fixed once per run (resumes keep the ledger's)
            restored = None if self._restored is None else self._restored.noise_mechanism
            self.correlated.fix_partition(restored, self._seeds.given, self.collectives.broadcast)
            loader = private_training_loader(dataloader, self.collectives, accumulate_grad_batches, **options,
                                             cyclic=self.correlated.sampler_options(self._charged_steps))
            self._loader_sampler = loader.batch_sampler
            return loader
        if self.privacy_unit == "user":  # Poisson sampling over users (sampling/users.py)
            data = describe_training_data(dataloader, self.collectives.world_size, pre_sharded)
            loader = user_level_loader(dataloader, self.collectives, accumulate_grad_batches, **options,
                                       max_examples_per_user=self.max_examples_per_user, batch_sizes=data.batch_sizes)
            self._user_sampler = loader.batch_sampler
            return loader
        return private_training_loader(dataloader, self.collectives, accumulate_grad_batches, **options)

    def fix_plan(self, loader: DataLoader, *, accumulate_grad_batches: int, micro_batches_per_epoch: int,
                 max_steps: Optional[int], max_epochs: Optional[int]) -> PrivacyPlan:
        """Fix the plan for the loader from :meth:`private_loader` (σ calibrated if asked) and open the ledger.
        A plan fixed again (a reloaded loader) keeps the σ of the first."""
        plan = PrivacyPlan.for_sampler(
            loader.batch_sampler, self.accounting, noise_multiplier=self.noise_multiplier,
            max_micro_batch_size=self.max_micro_batch_size, accumulate_grad_batches=accumulate_grad_batches,
            micro_batches_per_epoch=micro_batches_per_epoch, max_steps=max_steps, max_epochs=max_epochs)
        if self.correlated.banded:
            check_banded_supported(self.bands, max(micro_batches_per_epoch // accumulate_grad_batches, 1),
                                   self.poisson_sampling)
            plan = dataclasses.replace(plan, noise_mechanism=self.correlated.record())
        self.use_plan(plan)
        return plan

    def use_plan(self, plan: PrivacyPlan) -> None:
        """Charge every step with ``plan`` and open the ledger: the restored one, after checking it is for the
        same N and δ, else (once) a new one with a run id shared by the ranks."""
        self.plan = plan
        restored = self._restored
        if restored is not None:
            if restored.privacy_unit != plan.privacy_unit:
                raise ValueError(
                    f"The checkpoint's privacy ledger is for privacy unit {unit_text(restored.privacy_unit)}; this "
                    f"run's is {unit_text(plan.privacy_unit)}. Resume with the strategy's privacy_unit and "
                    "max_examples_per_user as the run was started with (its ε is in those units).")
            self.correlated.check_restored(restored.noise_mechanism)
            if restored.dataset_size != plan.dataset_size or restored.delta != plan.delta:
                raise ValueError(
                    f"The checkpoint's privacy ledger is for N={restored.dataset_size}, δ={restored.delta}; this "
                    f"run has N={plan.dataset_size}, δ={plan.delta}. Resume with the same data and delta.")
            self.ledger = restored
        elif self.ledger is None:
            # one run id on every rank, so every rank's copy of the ledger is the same document
            run_id = self.collectives.broadcast(secrets.token_hex(16))
            self.ledger = PrivacyLedger(delta=plan.delta, dataset_size=plan.dataset_size,
                                        accountant=plan.accountant, run_id=run_id, shard_sizes=plan.shard_sizes,
                                        privacy_unit=plan.privacy_unit, noise_mechanism=plan.noise_mechanism)

    # ------------------------------------------------------------------------------------------ resume
    def restore_ledger(self, ledger: PrivacyLedger) -> None:
        """Continue ``ledger`` (from a checkpoint) when the plan opens the ledger.

        Raises:
            ValueError: another ledger was restored already (two copies in one checkpoint disagree).
        """
        if self._restored is not None and self._restored != ledger:
            raise ValueError("The callback's ledger and the checkpoint's ledger disagree; refusing to resume.")
        self._restored = ledger

    def resume(self, ledger: PrivacyLedger, noise_state: Optional[dict] = None) -> None:
        """A checkpoint with ``ledger`` was loaded: continue it, with fresh noise and sampling streams.

        With an explicit seed, a resumed process would restart the noise stream at its first draw, so the steps
        after the checkpoint would reuse the noise of the run's first steps: the difference of two released
        updates would then cancel the noise exactly. A new seed is derived from the seed and the ledger's
        position (deterministic, the same on every rank) for the noise and for the sampler built after this.
        Without one, a fresh seed is drawn. A later load (a rollback) replaces the ledger restored before.
        ``noise_state``: this rank's BandMF noise history from the checkpoint (:meth:`noise_state`), which the
        noise continues (fresh draws, the same correlation)."""
        self._restored = None  # a new load: its ledger, not an earlier load's, is the one the others must match
        self.restore_ledger(ledger)
        self.correlated.load(noise_state, ledger.steps, self.collectives.global_rank)
        if self.secure_mode or self._noise_handle is None:  # secure: no seed to reuse; not fitting: no hook
            return
        self._renew_seed()  # (a rollback must not restart this fit's streams either)
        self.seed = self.stream_seed(ledger)
        self._noise_handle.remove()
        optimizer, replicated = self._noise_target
        self.install_noise(optimizer, replicated=replicated)

    def noise_state(self) -> Optional[dict]:
        """This rank's noise state for a checkpoint: BandMF's history of its partition (None for DP-SGD)."""
        return self.correlated.state_dict()

    def _charged_steps(self) -> int:
        return self.ledger.steps if self.ledger is not None else 0

    def _renew_seed(self) -> None:
        many = self.collectives.world_size > 1
        self._seeds.renew(lambda s: self.collectives.broadcast(s) if many else s)

    def stream_seed(self, ledger: Optional[PrivacyLedger]) -> Optional[int]:
        """The seed of the noise and sampling streams of a fit that continues ``ledger``: the seed given (or
        drawn) for a new ledger, else one derived from it and the ledger's position (run id, steps, head hash),
        the same on every rank and for every process that continues the ledger from that position, and distinct
        for every position, so no two fits of one lineage draw the same noise or batches."""
        return self._seeds.for_position(ledger)

    # ------------------------------------------------------------------------------------------ per micro-batch
    def training_step(self, run: Callable[[], Any], batch_size: Optional[int], *, module: Any = None,
                      step: Optional[int] = None, epoch: Optional[int] = None, stand_in_rows: int = 0,
                      loss_in_backward: bool = False) -> Any:
        """Run one micro-batch's ``training_step`` (``run()``), declared to the engine as ``batch_size`` examples
        (None: read from each layer's input), and stop on a non-finite loss (:meth:`check_finite_loss`).

        An empty Poisson batch is a valid noise-only step that every rank must run (collectives), on its zero rows
        or, with ``stand_in_rows``, on a stand-in of that many rows (``_collate.stand_in_batch``), of which the
        engine takes no example. The mean loss over no examples is NaN: ``module``'s ``log``/``log_dict`` calls
        are dropped for it, so no epoch mean turns NaN, and the loss handed to backward is 0. ``loss_in_backward``:
        ``run()`` runs its own backward (manual optimization), whose loss the driver hands to
        :meth:`micro_batch_loss` before it; ``run()``'s output is returned as it is."""
        self.engine.start_micro_batch(batch_size, stand_in_rows, units=self.units_of(batch_size))
        if batch_size != 0:
            return run() if loss_in_backward else self.check_finite_loss(run(), step, epoch)
        with logging_suppressed(module):
            out = run()
        if loss_in_backward:
            return without_rows(out) if stand_in_rows else out
        return self.check_finite_loss(zero_loss(without_rows(out) if stand_in_rows else out), step, epoch)

    def units_of(self, batch_size: Optional[int]) -> Optional[torch.Tensor]:
        """With ``privacy_unit="user"``: the user of each row of the micro-batch about to run (its sampler's, in the
        order drawn), ``(B,)`` for ``PerSampleEngine.start_micro_batch(units=...)``; ``None`` otherwise or for an
        empty one.

        Raises:
            RuntimeError: the micro-batch is not the size the sampler drew (a batch it did not draw)."""
        self.correlated.note_micro_batch(self._loader_sampler)  # BandMF: the step its part was drawn for
        if self._user_sampler is None:
            return None
        units = self._user_sampler.pop_units()
        if batch_size is not None and len(units) != batch_size:
            raise RuntimeError(f"privacy_unit='user': the micro-batch has {batch_size} rows but the user-level "
                               f"sampler drew {len(units)} for it, so its rows' users are unknown. Train on the "
                               "loader the strategy builds, and keep each batch's rows (no filtering in collate).")
        return torch.from_numpy(units) if len(units) else None

    def micro_batch_loss(self, loss: Any, batch_size: Optional[int], *, step: Optional[int] = None) -> Any:
        """What :meth:`training_step` does after ``run()``, for a driver whose user computes the loss outside a
        ``training_step`` (a Fabric loop: the engine was told of the micro-batch before its forward): an empty
        Poisson batch's loss (NaN, a mean over no examples) becomes 0, then :meth:`check_finite_loss`."""
        return self.check_finite_loss(zero_loss(loss) if batch_size == 0 else loss, step)

    def check_layout(self, rerun: Callable[[Optional[torch.Tensor]], Any], batch_size: Optional[int], *,
                     module: Any = None, every_batch: bool = False) -> bool:
        """The engine's layout check (:meth:`PerSampleEngine.check_layout`; ``every_batch``: then its spot
        check at every later micro-batch) over the run's ranks, ``module``'s ``log``/``log_dict`` calls dropped
        during its forwards; ``rerun(index)`` runs the micro-batch's ``training_step`` on the batch re-indexed
        by ``index``."""
        with logging_suppressed(module):
            return self.engine.check_layout(rerun, batch_size, self.collectives, every_batch=every_batch)

    def check_finite_loss(self, out: Any, step: Optional[int] = None, epoch: Optional[int] = None) -> Any:
        """Stop on a NaN/inf loss (any rank; all ranks agree in one all-reduce), with the step charged.

        A non-finite loss would give NaN per-example norms and coefficients, and a NaN update: never skip it
        silently. The step is charged before raising (conservative: whether the loss was finite depends on the
        batch and is now visible), nothing is applied, and every rank raises the same
        :class:`NonFiniteLossError`. ``step`` and ``epoch`` (the optimizer step being built, the epoch) only
        word the message."""
        if self.plan is None or self.ledger is None:
            return out
        loss = out.get("loss") if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            return out
        world = self.collectives.world_size
        flags = torch.stack([torch.logical_not(torch.isfinite(loss.detach()).all()).to(torch.float32),
                             torch.tensor(float(self._stop_requested), device=loss.device)])
        if world > 1:  # the one collective of every micro-batch: a stop request rides along (see request_stop)
            flags = sum_over_ranks(self.collectives, flags)
        bad, stop = flags.tolist()  # one device-to-host read for both
        self.stop_agreed = self.stop_agreed or stop > 0
        if bad == 0:
            return out
        self.charge()
        raise NonFiniteLossError(non_finite_loss_message(self.ledger, loss, int(bad), world, step, epoch))

    def probe_loss(self, loss: torch.Tensor, accumulate_grad_batches: int = 1,
                   gradient_accumulation_steps: int = 1) -> torch.Tensor:
        """``loss`` through the loss probe, to hand to backward: its backward reads the product ``g`` of every
        factor put on the loss after this point (``1/gradient_accumulation_steps`` and the loss scale of
        DeepSpeed's backward) and has the engine take norms of ``K/g`` times the output gradients, K being
        ``accumulate_grad_batches`` (Lightning's 1/K is on ``loss`` already), and write back ``g·gas`` (the loss
        scale, which DeepSpeed divides out) times the clipped sums (docs/design.md, *The factors on the loss*)."""
        return _LossProbe.apply(loss, self, accumulate_grad_batches, gradient_accumulation_steps)

    def _on_loss_grad(self, g: torch.Tensor, accumulate_grad_batches: int, gradient_accumulation_steps: int) -> None:
        g = float(g)
        if math.isinf(g) and self.loss_scaled_fp16:
            # fp16: the loss times DeepSpeed's loss scale overflowed (an fp16 loss at the default scale 2^16 does).
            # Every gradient emitted is NaN, so DeepSpeed's overflow check skips this step and lowers the scale, as
            # it does without DP; nothing of the batch is released, and the step is charged all the same (I4).
            self.engine.set_loss_factors(grad_scale=math.nan, emit_scale=math.nan)
            return
        if not math.isfinite(g) or g == 0:
            raise RuntimeError(f"The loss gradient is {g}; cannot recover per-example gradients.")
        if self.loss_factor_check is not None:
            self.loss_factor_check(g * gradient_accumulation_steps)
        # undo Lightning's 1/K, DeepSpeed's 1/gas and the loss scale; emit × S, which DeepSpeed divides out
        self.engine.set_loss_factors(grad_scale=accumulate_grad_batches / g,
                                     emit_scale=g * gradient_accumulation_steps)

    def request_stop(self) -> None:
        """Ask the run to stop (from a signal handler: no collective, no lock). Every rank learns it in the
        all-reduce of the next micro-batch's :meth:`check_finite_loss`, at the same point of every rank's program,
        and :attr:`stop_agreed` becomes True there on all ranks alike."""
        self._stop_requested = True

    # ------------------------------------------------------------------------------------------ per optimizer step
    def begin_fit(self, counts: Mapping[str, int]) -> None:
        """The drivers' own step counters at the start of a fit (e.g. Lightning's ``global_step``, DeepSpeed's
        ``global_steps``): from here each update must advance each of them and the ledger by one
        (:meth:`optimizer_step`'s ``counts``; :class:`~lightning_dpzero.accounting.step_counts.StepCounts`)."""
        self._counts.begin(self.ledger.steps if self.ledger is not None else 0, counts)

    def charge(self) -> None:
        """Charge one step (q, σ, sampler, micro-batch bound) of the plan to the ledger (BandMF: after checking
        that the step's micro-batches came from its part)."""
        self.correlated.check_step(self.ledger.steps)
        self.ledger.charge(self.plan.sample_rate, self.plan.noise_multiplier, self.plan.sampler_kind,
                           bound=self.plan.micro_batch_bound)

    def optimizer_step(self, step: Callable[[Callable[[], Any]], Any], closure: Callable[[], Any], *,
                       boundary: bool, step_applied: Callable[[], bool],
                       counts: Optional[Callable[[], Mapping[str, int]]] = None) -> Any:
        """``step(charged_closure)``: the driver's optimizer step with a closure that runs ``closure`` and then, at
        an accumulation ``boundary``, charges the ledger, before the update is applied (I4: skipped, overflowed
        steps are charged too). ``counts()``: the drivers' step counters with this update included, which must
        have advanced as the ledger did since :meth:`begin_fit` (else ``RuntimeError`` before the update). After
        it, an update that was applied (``step_applied()``) without the noise hook having run stops training. The noised
        optimizer may update each parameter once, and only between the charge and the end of ``step``
        (:class:`~lightning_dpzero.accounting.step_counts.ChargedUpdates`)."""

        def charged_closure() -> Any:
            result = closure()
            if boundary:
                self.charge()
                if counts is not None:
                    self._counts.check(self.ledger.steps, counts())
                self._updates.open()  # the noised optimizer may now update each parameter once
            return result

        self._noise_applied = False
        try:
            out = step(charged_closure)
        finally:
            self._updates.close()
        if boundary and self.correlated.cyclic and not step_applied():
            raise RuntimeError("noise_mechanism='banded-mf': an optimizer step was charged but skipped, which leaves "
                               "the correlated noise behind the cyclic parts; refusing to continue.")
        if boundary and step_applied() and not self._noise_applied:
            raise RuntimeError("An optimizer step was applied without the DP noise hook running; refusing to "
                               "continue with a non-private update.")
        return out

    def take_stats(self, read: bool = True) -> Optional[StepStats]:
        """This rank's clipping statistics since the last call, and reset them (the callback's metrics);
        ``read=False``: reset them unread, ``None`` (they stay on the device until read: a read waits for it)."""
        if not read:
            self.engine.reset_stats()
            return None
        stats = self.engine.stats
        out = StepStats(int(stats["examples"]), int(stats["clipped"]), float(stats["norm_sum"]))
        self.engine.reset_stats()
        return out
