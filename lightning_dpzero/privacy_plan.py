"""The privacy plan of a run: q, σ, δ, N, B_exp and the planned number of optimizer steps.

Fixed once the training loader is known (before the first step), so σ can be calibrated from a target ε
and checked against it (DESIGN §5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .accounting import calibrate_noise_multiplier, epsilon_for

DEFAULT_DELTA = 1e-5


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
    """

    dataset_size: int
    sample_rate: float
    expected_batch_size: float
    noise_multiplier: float
    delta: float
    planned_steps: Optional[int]
    sampler_kind: str
    accountant: str = "pld"
    target_epsilon: Optional[float] = None

    @classmethod
    def build(cls, strategy, trainer, loader, n: int, q: float) -> "PrivacyPlan":
        cb = strategy.accountant_callback
        delta = cb.delta if cb is not None else DEFAULT_DELTA
        accountant = cb.accountant if cb is not None else "pld"
        target = cb.target_epsilon if cb is not None else None
        k = trainer.accumulate_grad_batches
        micro = len(loader)
        limit = trainer.limit_train_batches
        if isinstance(limit, int):
            micro = min(micro, limit)
        elif limit is not None and limit < 1.0:
            micro = int(micro * limit)
        steps_per_epoch = max(micro // k, 1)
        planned: Optional[int] = None
        if trainer.max_steps is not None and trainer.max_steps > 0:
            planned = trainer.max_steps
        elif trainer.max_epochs is not None and trainer.max_epochs > 0:
            planned = trainer.max_epochs * steps_per_epoch
        sigma = strategy.noise_multiplier
        if target is not None:
            if planned is None and sigma is None:
                raise ValueError("target_epsilon needs a bounded run to calibrate σ: set Trainer(max_steps=...) "
                                 "or Trainer(max_epochs=...), or pass an explicit noise_multiplier (training then "
                                 "stops when the budget is spent).")
            if sigma is None:
                sigma = calibrate_noise_multiplier(target, delta, q, planned, accountant)
                strategy.noise_multiplier = sigma
            elif planned is not None:
                eps = epsilon_for(sigma, delta, q, planned, accountant)
                if eps > target:
                    fits = _steps_within(target, delta, q, sigma, accountant)
                    raise ValueError(
                        f"noise_multiplier={sigma} gives ε={eps:.3g} > target_epsilon={target} after the planned "
                        f"{planned} steps (q={q:.4g}, δ={delta}); only {fits} steps fit in the budget. Remove "
                        "noise_multiplier to calibrate it, raise it, or train at most that many steps.")
        if sigma is None:
            raise ValueError("No noise multiplier: pass DPDeepSpeedStrategy(noise_multiplier=σ) or add "
                             "PrivacyAccountantCallback(target_epsilon=..., delta=...) to calibrate σ.")
        if sigma == 0:
            rank_zero_warn("noise_multiplier=0: gradients are clipped but not noised, so ε is infinite.")
        sampler_kind = loader.batch_sampler.sampler_kind
        if sampler_kind == "shuffle" and sigma > 0:
            warn_shuffle_accounting()
        if delta >= 1.0 / n:
            rank_zero_warn(f"delta={delta} >= 1/N = {1.0 / n:.3g}: such a δ allows leaking a whole example; "
                           "use δ well below 1/N.")
        return cls(dataset_size=n, sample_rate=q, expected_batch_size=q * n, noise_multiplier=float(sigma),
                   delta=delta, planned_steps=planned, sampler_kind=sampler_kind,
                   accountant=accountant, target_epsilon=target)


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
    from .accounting import BudgetGuard, PrivacyLedger

    if sigma == 0:
        return 0
    return BudgetGuard(target).steps_within_budget(PrivacyLedger(delta, 1, accountant), q, sigma)
