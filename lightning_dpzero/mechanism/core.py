"""The DP step's object (:class:`DPMechanism`; the package's docstring says what a driver calls, in which order):
its settings, the noise hook, resume, the per-micro-batch and per-step calls. Its loss checks are in ``loss.py``
and its loader and plan in ``data.py``."""

from __future__ import annotations

import dataclasses

import math
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch

from ..util.collectives import Collectives, SingleProcess
from ..sampling.micro_batch import logging_suppressed, without_rows, zero_loss
from ..accounting.step_counts import ChargedUpdates, StepCounts
from ..accounting import PrivacyLedger
from ..accounting.truncation import check_max_micro_batch_size
from ..noise import NoiseSource, StreamSeeds, make_noise_pre_hook, warn_explicit_seed
from .correlated import CorrelatedNoise
from ..per_sample import PerSampleEngine
from ..accounting.plan import AccountingSettings, PrivacyPlan
from ..sampling.users import check_privacy_unit
from .data import PlanAndData
from .loss import LossChecks


class StepStats(NamedTuple):
    """The clipping statistics of this rank since the last :meth:`DPMechanism.take_stats`."""

    examples: int    #: examples whose per-example norms were taken
    clipped: int     #: of those, the examples whose total norm exceeded C (scaled down)
    norm_sum: float  #: sum of their total per-example norms (before clipping)


class DPMechanism(PlanAndData, LossChecks):
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
        privacy_unit: ``"example"`` (default) or ``"user"``: user-level DP (docs/how-to/user-level-dp.md).
        max_examples_per_user: k, the rows a sampled user contributes (``privacy_unit="user"`` only).
        noise_mechanism: ``"dp-sgd"`` (default) or ``"banded-mf"``: noise correlated over ``bands`` steps with
            cyclic Poisson sampling (:class:`~lightning_dpzero.mechanism.correlated.CorrelatedNoise`,
            docs/how-to/correlated-noise.md).
        bands: b, for ``"banded-mf"``.

    Raises:
        ValueError: σ negative or not finite; σ > 0 with C = inf; b not an integer >= 1; what
            :class:`~lightning_dpzero.mechanism.correlated.CorrelatedNoise` refuses.

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
        self.correlated.load(noise_state, ledger.steps, self.collectives.global_rank, ledger.noise_mechanism,
                             self._loader_sampler)
        if self.plan is not None and self.correlated.cyclic and self.plan.sampler_kind != self.correlated.sampler_kind():
            # a plan fixed before the load (Fabric) charges the ledger's BLT θ, ω from now on
            kind = self.correlated.sampler_kind()
            self.plan = dataclasses.replace(self.plan, sampler_kind=kind, noise_mechanism=self.correlated.record())
            if self._loader_sampler is not None:
                self._loader_sampler.sampler_kind = kind
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

    def check_layout(self, rerun: Callable[[Optional[torch.Tensor]], Any], batch_size: Optional[int], *,
                     module: Any = None, every_batch: bool = False) -> bool:
        """The engine's layout check (:meth:`PerSampleEngine.check_layout`; ``every_batch``: then its spot
        check at every later micro-batch) over the run's ranks, ``module``'s ``log``/``log_dict`` calls dropped
        during its forwards; ``rerun(index)`` runs the micro-batch's ``training_step`` on the batch re-indexed
        by ``index``."""
        with logging_suppressed(module):
            return self.engine.check_layout(rerun, batch_size, self.collectives, every_batch=every_batch)

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
