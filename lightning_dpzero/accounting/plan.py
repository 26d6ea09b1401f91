"""The privacy plan of a run: q, σ, δ, N, B_exp and the planned number of optimizer steps.

Fixed once the training loader is known (before the first step), so σ can be calibrated from a target ε and
checked against it (docs/design.md, *Where each piece runs* and *Accounting and the ledger*). It is built from
plain numbers, so any driver of the mechanism (the Lightning strategy, a Fabric loop, the audit) can fix one.
"""

from __future__ import annotations

import dataclasses

import math
import warnings
from dataclasses import dataclass
from typing import Optional

# lightning_utilities (not lightning.pytorch): the planner builds plans without importing Lightning
from lightning_utilities.core.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_warn as _rank_zero_warn

from ..util.options import Accountant, Sampler, check_number, check_option
from . import BudgetGuard, PrivacyLedger, calibrate_noise_multiplier, epsilon_for
from .accountants import _check_delta
from .banded import equivalent_run, noise_scale
from .truncation import (MAX_SHARE, MicroBatchBound, smallest_micro_batch_bound, step_probability,
                                   truncation_share)

DEFAULT_DELTA = 1e-5


@dataclass(frozen=True)
class AccountingSettings:
    """What a run's (ε, δ) guarantee is stated in: the accountant callback hands these to the mechanism.

    Attributes:
        target_epsilon: ε budget (None: no budget; σ must then be given).
        delta: δ of the reported (ε, δ), in (0, 1); keep it well below 1/N.
        accountant: ``"pld"`` (privacy loss distributions, tight) or ``"rdp"`` (Rényi DP).

    Raises:
        ValueError: a target ε that is not a finite number > 0, δ outside (0, 1), another accountant.

    Example:
        >>> AccountingSettings(target_epsilon=8.0, delta=1e-5)
        AccountingSettings(target_epsilon=8.0, delta=1e-05, accountant='pld')
        >>> AccountingSettings(delta=0.0)
        Traceback (most recent call last):
        ...
        ValueError: delta must be in (0, 1), got 0.0; typical is 1e-5 or below 1/N (e.g. 1/N**1.1 for N examples).
    """

    target_epsilon: Optional[float] = None
    delta: float = DEFAULT_DELTA
    accountant: Accountant = "pld"

    def __post_init__(self) -> None:
        eps = check_number("target_epsilon", self.target_epsilon, optional=True)
        check_number("delta", self.delta)
        if eps is not None and not (eps > 0 and math.isfinite(eps)):
            raise ValueError(f"target_epsilon must be a finite number > 0, got {eps!r}.")
        _check_delta(self.delta)
        check_option("accountant", self.accountant, Accountant)


@dataclass
class PrivacyPlan:
    """What every optimizer step of the run is charged with.

    Attributes:
        dataset_size: N, examples in the training set.
        sample_rate: q = B·W·K / N (B per-device micro-batch, W processes, K accumulation).
        expected_batch_size: B_exp = q·N, the divisor of the released gradient.
        noise_multiplier: σ actually used.
        delta: δ of the reported (ε, δ).
        planned_steps: optimizer steps the trainer will run (None if unbounded).
        sampler_kind: "poisson" or "shuffle".
        accountant: "pld" or "rdp".
        target_epsilon: the ε budget σ was calibrated to or checked against (None: no budget).
        shard_sizes: pre-sharded data: each rank's shard length (their sum is N); None: one global dataset.
        micro_batch_bound: bounded micro-batches (b, K, each rank's examples), or None.
        truncation_delta: with a bound and planned steps, the part (1 + e^ε)·p(T) of δ the truncation takes at
            the ε of the planned steps (σ is calibrated with it taken from δ); else None.

    Example:
        >>> plan = PrivacyPlan.build(dataset_size=60_000, sample_rate=256 / 60_000, sampler_kind="poisson",
        ...                          accumulate_grad_batches=1, micro_batches_per_epoch=234, max_steps=None,
        ...                          max_epochs=3, noise_multiplier=1.1)
        >>> plan.planned_steps, plan.expected_batch_size, plan.noise_multiplier
        (702, 256.0, 1.1)
    """

    dataset_size: int
    sample_rate: float
    expected_batch_size: float
    noise_multiplier: float
    delta: float
    planned_steps: Optional[int]
    sampler_kind: Sampler
    accountant: Accountant = "pld"
    target_epsilon: Optional[float] = None
    shard_sizes: Optional[tuple[int, ...]] = None
    micro_batch_bound: Optional[MicroBatchBound] = None
    truncation_delta: Optional[float] = None
    privacy_unit: Optional[dict] = None
    """User-level DP: ``{"unit": "user", "max_examples_per_user": k}``, N and q then count users; None: examples."""
    noise_mechanism: Optional[dict] = None
    """Correlated noise (banded matrix factorization): the ledger's record of it (``PrivacyLedger``'s
    ``noise_mechanism``); None: DP-SGD."""

    @property
    def truncation_probability(self) -> float:
        """p(T) over the planned steps: the bound on the probability that the micro-batch bound ever truncates a
        draw (0.0 without a bound or without planned steps)."""
        return _planned_truncation(self.micro_batch_bound, self.sample_rate, self.planned_steps)

    @classmethod
    def for_sampler(cls, sampler, settings: "AccountingSettings", *, noise_multiplier: Optional[float],
                    max_micro_batch_size: Optional[int], accumulate_grad_batches: int,
                    micro_batches_per_epoch: int, max_steps: Optional[int], max_epochs: Optional[int]
                    ) -> "PrivacyPlan":
        """:meth:`build` for the DP batch sampler a training loader really uses (its N, q, kind and shards);
        a ``max_micro_batch_size`` binds Poisson sampling only (fixed-size batches are never cut)."""
        b = max_micro_batch_size if sampler.sampler_kind == "poisson" else None
        bound = None if b is None else MicroBatchBound(b, accumulate_grad_batches, sampler.rank_sizes)
        plan = cls.build(
            dataset_size=sampler.num_samples, sample_rate=sampler.sample_rate, sampler_kind=sampler.sampler_kind,
            accumulate_grad_batches=accumulate_grad_batches, micro_batches_per_epoch=micro_batches_per_epoch,
            max_steps=max_steps, max_epochs=max_epochs, noise_multiplier=noise_multiplier,
            target_epsilon=settings.target_epsilon, delta=settings.delta, accountant=settings.accountant,
            shard_sizes=sampler.shard_sizes, micro_batch_bound=bound)
        unit = getattr(sampler, "privacy_unit", None)  # user_sampling.UserPoissonBatchSampler's
        return plan if unit is None else dataclasses.replace(plan, privacy_unit=dict(unit))

    @classmethod
    def build(cls, *, dataset_size: int, sample_rate: float, sampler_kind: Sampler, accumulate_grad_batches: int,
              micro_batches_per_epoch: int, max_steps: Optional[int], max_epochs: Optional[int],
              noise_multiplier: Optional[float], target_epsilon: Optional[float] = None,
              delta: float = DEFAULT_DELTA, accountant: Accountant = "pld",
              shard_sizes: Optional[tuple[int, ...]] = None,
              micro_batch_bound: Optional[MicroBatchBound] = None) -> "PrivacyPlan":
        """Fix the plan of a run: the planned steps, and σ calibrated to ``target_epsilon`` when not given.

        Args:
            dataset_size: N.
            sample_rate: q.
            sampler_kind: ``"poisson"``, ``"shuffle"`` or ``"cyclic-poisson:<b>"`` (the sampler the loader really
                uses; the last is accounted as its equivalent rounds, :func:`.banded.equivalent_run`).
            accumulate_grad_batches: K, micro-batches per optimizer step.
            micro_batches_per_epoch: micro-batches one epoch runs (after any limit on the training batches).
            max_steps: the run's optimizer steps if bounded by steps (None or <= 0: not).
            max_epochs: the run's epochs if bounded by epochs (None or <= 0: not); planned steps are then
                ``max_epochs * max(micro_batches_per_epoch // K, 1)``.
            noise_multiplier: σ, or None to calibrate it from ``target_epsilon``.
            target_epsilon, delta, accountant: see :class:`AccountingSettings`.
            shard_sizes: see the attribute (recorded, not used in the arithmetic: N is already their sum).
            micro_batch_bound: bounded micro-batches: ε and σ are those with the truncation's (1 + e^ε)·p(T)
                taken from δ (:mod:`lightning_dpzero.accounting.truncation`).

        Raises:
            ValueError: no σ and no target; a target for an unbounded run without σ; an explicit σ whose ε over
                the planned steps exceeds the target (naming how many steps fit); a micro-batch bound whose
                truncation would take more than half of δ over the planned steps (naming the smallest b that
                fits).
        """
        q, n = sample_rate, dataset_size
        steps_per_epoch = max(micro_batches_per_epoch // accumulate_grad_batches, 1)
        planned: Optional[int] = None
        if max_steps is not None and max_steps > 0:
            planned = max_steps
        elif max_epochs is not None and max_epochs > 0:
            planned = max_epochs * steps_per_epoch
        sigma = noise_multiplier
        # what the accountant composes: the steps themselves, or a cyclic sampler's rounds (correlated noise)
        q_acc, _, planned_acc = equivalent_run(q, 0.0, planned or 0, sampler_kind)
        planned_acc = planned_acc if planned else planned
        p = _planned_truncation(micro_batch_bound, q, planned)
        if p > 0.0 and target_epsilon is not None:
            check_truncation(micro_batch_bound, q, planned, delta, target_epsilon, p)
        if target_epsilon is not None:
            if planned is None and sigma is None:
                raise ValueError("target_epsilon needs a bounded run to calibrate σ: set Trainer(max_steps=...) "
                                 "or Trainer(max_epochs=...), or pass an explicit noise_multiplier (training then "
                                 "stops when the budget is spent).")
            scale = noise_scale(sampler_kind, planned)  # BLT: σ = σ_acc · Δ over the planned steps (else 1)
            if sigma is None:
                sigma = scale * calibrate_noise_multiplier(target_epsilon, delta, q_acc, planned_acc, accountant,
                                                           truncation=p)
            elif planned is not None:
                eps = epsilon_for(sigma / scale, delta, q_acc, planned_acc, accountant, truncation=p)
                if eps > target_epsilon:
                    raise ValueError(_over_budget(sigma, eps, target_epsilon, delta, q, planned, accountant,
                                                  micro_batch_bound, sampler_kind))
        if sigma is None:
            raise ValueError("No noise multiplier: pass DPDeepSpeedStrategy(noise_multiplier=σ) or add "
                             "PrivacyAccountantCallback(target_epsilon=..., delta=...) to calibrate σ.")
        share = None
        if p > 0.0 and sigma > 0:
            eps_planned = epsilon_for(sigma, delta, q, planned, accountant, truncation=p)
            if target_epsilon is None:
                check_truncation(micro_batch_bound, q, planned, delta, eps_planned, p, sigma, accountant)
            share = truncation_share(eps_planned, p)
        elif micro_batch_bound is not None and planned is not None:
            share = 0.0
        if sigma == 0:
            rank_zero_warn("noise_multiplier=0: gradients are clipped but not noised, so ε is infinite.")
        if sampler_kind == "shuffle" and sigma > 0:
            warn_shuffle_accounting()
        if delta >= 1.0 / n:
            rank_zero_warn(f"delta={delta} >= 1/N = {1.0 / n:.3g}: such a δ allows leaking a whole example; "
                           "use δ well below 1/N.")
        return cls(dataset_size=n, sample_rate=q, expected_batch_size=q * n, noise_multiplier=float(sigma),
                   delta=delta, planned_steps=planned, sampler_kind=sampler_kind,
                   accountant=accountant, target_epsilon=target_epsilon, shard_sizes=shard_sizes,
                   micro_batch_bound=micro_batch_bound, truncation_delta=share)


def _planned_truncation(bound: Optional[MicroBatchBound], q: float, planned: Optional[int]) -> float:
    return 0.0 if not planned else planned * step_probability(bound, q)


def check_truncation(bound: MicroBatchBound, q: float, steps: int, delta: float, epsilon: float, p: float,
                     sigma: Optional[float] = None, accountant: str = "pld") -> None:
    """Refuse a micro-batch bound whose truncation takes more than half of δ, (1 + e^ε)·p(T) > δ/2, at ε (the
    target, or the ε of the planned steps for a given σ), naming the smallest b that fits and the alternatives."""
    share = truncation_share(epsilon, p)
    if share <= MAX_SHARE * delta:
        return
    if sigma is not None:  # no target: the smallest b is sized at the ε the untruncated run has at δ/2
        epsilon = epsilon_for(sigma, MAX_SHARE * delta, q, steps, accountant)
    smallest = smallest_micro_batch_bound(q, bound.accumulate_grad_batches, bound.rank_sizes, steps, delta, epsilon)
    k = bound.accumulate_grad_batches
    expected = q * max(bound.rank_sizes) / k
    raise ValueError(
        f"max_micro_batch_size={bound.max_micro_batch_size} is too small for this run: a rank's Poisson sample of "
        f"a step exceeds accumulate_grad_batches {k} x {bound.max_micro_batch_size} examples with probability up to "
        f"{min(p / steps, 1.0):.3g} per step, and over the planned {steps} steps the truncation would take "
        f"(1 + e^ε)·p(T) = {share:.3g} (ε = {epsilon:.4g}): more than half of delta={delta:g}. Use "
        f"max_micro_batch_size >= {smallest} "
        f"(the expected micro-batch is {expected:.3g}), or raise accumulate_grad_batches (with a smaller "
        "DataLoader batch_size), or train fewer steps, or leave max_micro_batch_size unset.")


def rank_zero_warn(message: str) -> None:
    """Warn on rank 0 only; outside a Lightning run (``lightning-dpzero plan``: one process, no rank set) as a
    plain ``UserWarning``."""
    if getattr(rank_zero_only, "rank", None) is None:
        warnings.warn(message, UserWarning, stacklevel=3)
    else:
        _rank_zero_warn(message)


SHUFFLE_ACCOUNTING_WARNING = (
    "poisson_sampling=False: training on shuffled fixed-size batches, but the privacy accountant assumes Poisson "
    "subsampling (each example in each step independently with probability q). Shuffled batches are not what it "
    "analyses, and the reported ε can be optimistic, i.e. smaller than the true privacy loss (Chua et al. 2024, "
    "\"How Private are DP-SGD Implementations?\"). Use poisson_sampling=True (the default) for a guarantee that "
    "holds as reported.")


def warn_shuffle_accounting() -> None:
    """Warn, on rank 0, that shuffled batches are accounted as if Poisson-subsampled. `PrivacyPlan.build` calls it
    once per fit when the loader has the shuffle sampler and σ > 0."""
    rank_zero_warn(SHUFFLE_ACCOUNTING_WARNING)


def limited_micro_batches(micro_batches: int, limit_train_batches) -> int:
    """Micro-batches an epoch runs under ``Trainer(limit_train_batches=...)`` (an int: at most that many; a
    fraction below 1: that share)."""
    if isinstance(limit_train_batches, int):
        return min(micro_batches, limit_train_batches)
    if limit_train_batches < 1.0:
        return int(micro_batches * limit_train_batches)
    return micro_batches


def _over_budget(sigma: float, eps: float, target: float, delta: float, q: float, planned: int, accountant: str,
                 bound: Optional[MicroBatchBound], sampler: str = "poisson") -> str:
    """The refusal of an explicit σ whose ε over the planned steps exceeds the target: how many steps fit, or,
    where not even one does, what one step costs and the settings that make room."""
    head = (f"noise_multiplier={sigma} gives ε={eps:.3g} > target_epsilon={target} after the planned {planned} "
            f"steps (q={q:.4g}, δ={delta}); ")
    fits = _steps_within(target, delta, q, sigma, accountant, bound, sampler)
    if fits > 0:
        return (head + f"only {fits} steps fit in the budget. Remove noise_multiplier to calibrate it, raise it, or "
                f"train at most {fits} steps (Trainer(max_steps={fits})).")
    if sigma > 0:
        q_one, sigma_one, _ = equivalent_run(q, sigma, 1, sampler)
        one = epsilon_for(sigma_one, delta, q_one, 1, accountant, truncation=_planned_truncation(bound, q, 1))
        cost = f"a single step already costs ε={one:.3g}"
    else:
        cost = "without noise every step costs ε=∞"
    return (head + f"no step fits at this σ: {cost}. Remove noise_multiplier to "
            "calibrate it (or raise it), raise target_epsilon, or lower the sample rate q (a smaller DataLoader "
            "batch_size, or more training examples).")


def _steps_within(target: float, delta: float, q: float, sigma: float, accountant: str,
                  bound: Optional[MicroBatchBound] = None, sampler: str = "poisson") -> int:
    """Steps (q, σ) with ``sampler`` that fit in ε ≤ target (for messages)."""
    if sigma == 0:
        return 0
    return BudgetGuard(target).steps_within_budget(PrivacyLedger(delta, 1, accountant), q, sigma, sampler,
                                                   bound=bound)
