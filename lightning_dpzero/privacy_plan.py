"""The privacy plan of a run: q, σ, δ, N, B_exp and the planned number of optimizer steps.

Fixed once the training loader is known (before the first step), so σ can be calibrated from a target ε and
checked against it (docs/design.md, *Where each piece runs* and *Accounting and the ledger*). It is built from
plain numbers, so any driver of the mechanism (the Lightning strategy, a Fabric loop, the audit) can fix one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ._options import Accountant, Sampler, check_option
from .accounting import BudgetGuard, PrivacyLedger, calibrate_noise_multiplier, epsilon_for
from .accounting.accountants import _check_delta

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
        eps = self.target_epsilon
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

    @classmethod
    def build(cls, *, dataset_size: int, sample_rate: float, sampler_kind: Sampler, accumulate_grad_batches: int,
              micro_batches_per_epoch: int, max_steps: Optional[int], max_epochs: Optional[int],
              noise_multiplier: Optional[float], target_epsilon: Optional[float] = None,
              delta: float = DEFAULT_DELTA, accountant: Accountant = "pld") -> "PrivacyPlan":
        """Fix the plan of a run: the planned steps, and σ calibrated to ``target_epsilon`` when not given.

        Args:
            dataset_size: N.
            sample_rate: q.
            sampler_kind: ``"poisson"`` or ``"shuffle"`` (the sampler the loader really uses).
            accumulate_grad_batches: K, micro-batches per optimizer step.
            micro_batches_per_epoch: micro-batches one epoch runs (after any limit on the training batches).
            max_steps: the run's optimizer steps if bounded by steps (None or <= 0: not).
            max_epochs: the run's epochs if bounded by epochs (None or <= 0: not); planned steps are then
                ``max_epochs * max(micro_batches_per_epoch // K, 1)``.
            noise_multiplier: σ, or None to calibrate it from ``target_epsilon``.
            target_epsilon, delta, accountant: see :class:`AccountingSettings`.

        Raises:
            ValueError: no σ and no target; a target for an unbounded run without σ; an explicit σ whose ε over
                the planned steps exceeds the target (naming how many steps fit).
        """
        q, n = sample_rate, dataset_size
        steps_per_epoch = max(micro_batches_per_epoch // accumulate_grad_batches, 1)
        planned: Optional[int] = None
        if max_steps is not None and max_steps > 0:
            planned = max_steps
        elif max_epochs is not None and max_epochs > 0:
            planned = max_epochs * steps_per_epoch
        sigma = noise_multiplier
        if target_epsilon is not None:
            if planned is None and sigma is None:
                raise ValueError("target_epsilon needs a bounded run to calibrate σ: set Trainer(max_steps=...) "
                                 "or Trainer(max_epochs=...), or pass an explicit noise_multiplier (training then "
                                 "stops when the budget is spent).")
            if sigma is None:
                sigma = calibrate_noise_multiplier(target_epsilon, delta, q, planned, accountant)
            elif planned is not None:
                eps = epsilon_for(sigma, delta, q, planned, accountant)
                if eps > target_epsilon:
                    fits = _steps_within(target_epsilon, delta, q, sigma, accountant)
                    raise ValueError(
                        f"noise_multiplier={sigma} gives ε={eps:.3g} > target_epsilon={target_epsilon} after the "
                        f"planned {planned} steps (q={q:.4g}, δ={delta}); only {fits} steps fit in the budget. "
                        "Remove noise_multiplier to calibrate it, raise it, or train at most that many steps.")
        if sigma is None:
            raise ValueError("No noise multiplier: pass DPDeepSpeedStrategy(noise_multiplier=σ) or add "
                             "PrivacyAccountantCallback(target_epsilon=..., delta=...) to calibrate σ.")
        if sigma == 0:
            rank_zero_warn("noise_multiplier=0: gradients are clipped but not noised, so ε is infinite.")
        if sampler_kind == "shuffle" and sigma > 0:
            warn_shuffle_accounting()
        if delta >= 1.0 / n:
            rank_zero_warn(f"delta={delta} >= 1/N = {1.0 / n:.3g}: such a δ allows leaking a whole example; "
                           "use δ well below 1/N.")
        return cls(dataset_size=n, sample_rate=q, expected_batch_size=q * n, noise_multiplier=float(sigma),
                   delta=delta, planned_steps=planned, sampler_kind=sampler_kind,
                   accountant=accountant, target_epsilon=target_epsilon)


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


def _steps_within(target: float, delta: float, q: float, sigma: float, accountant: str) -> int:
    """Steps (q, σ) that fit in ε ≤ target (for messages)."""
    if sigma == 0:
        return 0
    return BudgetGuard(target).steps_within_budget(PrivacyLedger(delta, 1, accountant), q, sigma)
