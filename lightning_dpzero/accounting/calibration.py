"""Noise calibration: the smallest-ish noise multiplier that meets a target epsilon.

Epsilon of ``steps`` Poisson-subsampled Gaussian steps is computed by dp-accounting (PLD by default,
Koskela et al. 2020 / Doroshenko et al. 2022; or RDP, Mironov 2017) and is decreasing in sigma, so
sigma is found by bracketing followed by a safeguarded bisection on log(sigma). The answer is
*conservative* (epsilon(sigma) <= target) and *tight* (epsilon(sigma) >= target * (1 - rtol)).
"""

from __future__ import annotations

import math

from .accountants import _check_accountant, _check_delta, compute_epsilon
from .ledger import LedgerEntry

#: Search range for sigma. Below the floor the PLD grids get very large; above the ceiling no
#: realistic target needs more noise.
SIGMA_MIN, SIGMA_MAX = 0.05, 1.0e4


def _check_common(delta, sample_rate, steps) -> tuple:
    delta = _check_delta(delta)
    if isinstance(sample_rate, bool) or not 0.0 < float(sample_rate) <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}; pass the expected "
                         "batch size divided by the dataset size.")
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}; pass the number of "
                         "optimizer steps of the whole run (epochs / sample_rate for full epochs).")
    return delta, float(sample_rate), int(steps)


def epsilon_for(noise_multiplier: float, delta: float, sample_rate: float, steps: int,
                accountant: str = "pld") -> float:
    """Epsilon (nats) of ``steps`` Poisson-subsampled Gaussian steps with sample rate q =
    ``sample_rate`` in (0, 1] and noise multiplier sigma = ``noise_multiplier`` >= 0, at ``delta``
    in (0, 1), by ``accountant`` ("pld" default, or "rdp"). ``math.inf`` for sigma == 0.

    Raises ValueError naming the bad argument."""
    delta, q, steps = _check_common(delta, sample_rate, steps)
    _check_accountant(accountant)
    s = float(noise_multiplier)
    if not (s >= 0.0 and math.isfinite(s)):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}.")
    return compute_epsilon([LedgerEntry(q, s, steps)], delta, accountant)


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                               accountant: str = "pld", rtol: float = 0.01) -> float:
    """Noise multiplier sigma with ``target_epsilon * (1 - rtol) <= epsilon(sigma) <= target_epsilon``.

    Args:
        target_epsilon: epsilon to reach (nats), > 0.
        delta: delta in (0, 1).
        sample_rate: Poisson sample rate q in (0, 1] (expected batch size / dataset size).
        steps: number of optimizer steps, >= 1.
        accountant: "pld" (default, tight) or "rdp".
        rtol: relative tolerance in (0, 1) below the target (default 0.01).

    Returns:
        sigma (float).

    Raises:
        ValueError: naming the argument and the fix for invalid inputs, and when the target cannot be met
            in [SIGMA_MIN, SIGMA_MAX] (e.g. a target so small that even sigma = 1e4 exceeds it, or
            q <= delta so that epsilon stays below the target for any noise).
    """
    te = float(target_epsilon)
    if not (te > 0.0 and math.isfinite(te)):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}; "
                         "pass e.g. 8.0 (epsilon = 0 would need infinite noise).")
    delta, q, steps = _check_common(delta, sample_rate, steps)
    _check_accountant(accountant)
    if not 0.0 < float(rtol) < 1.0:
        raise ValueError(f"rtol must be in (0, 1), got {rtol!r}; the default 0.01 means within 1 %.")
    lo_target = te * (1.0 - float(rtol))

    def eps(sigma: float) -> float:
        return compute_epsilon([LedgerEntry(q, sigma, steps)], delta, accountant)

    def ok(e: float) -> bool:
        return lo_target <= e <= te

    # Bracket: sigma_lo too little noise (eps > te), sigma_hi enough (eps <= te).
    sigma = 1.0
    e = eps(sigma)
    if ok(e):
        return sigma
    if e > te:
        lo, e_lo = sigma, e
        while True:
            sigma = min(sigma * 2.0, SIGMA_MAX)
            e = eps(sigma)
            if ok(e):
                return sigma
            if e <= te:
                hi, e_hi = sigma, e
                break
            if sigma >= SIGMA_MAX:
                raise ValueError(f"target_epsilon={te} needs sigma > {SIGMA_MAX:g} for q={q}, "
                                 f"steps={steps}, delta={delta}: raise target_epsilon or delta, or "
                                 "lower sample_rate or steps.")
            lo, e_lo = sigma, e
    else:
        hi, e_hi = sigma, e
        while True:
            sigma = max(sigma / 2.0, SIGMA_MIN)
            e = eps(sigma)
            if ok(e):
                return sigma
            if e > te:
                lo, e_lo = sigma, e
                break
            if sigma <= SIGMA_MIN:
                raise ValueError(f"target_epsilon={te} is not reached even with sigma={SIGMA_MIN} "
                                 f"(epsilon={e:.4g}) for q={q}, steps={steps}, delta={delta}: "
                                 "raise target_epsilon or lower delta (delta must be << sample_rate).")
            hi, e_hi = sigma, e

    # Safeguarded regula falsi on (log sigma, log eps), aiming at the middle of the window;
    # falls back to plain bisection when the interpolation is unusable or slow.
    goal = math.log(0.5 * (lo_target + te))
    for it in range(100):
        x_lo, x_hi = math.log(lo), math.log(hi)
        x = 0.5 * (x_lo + x_hi)
        if it % 3 != 2 and math.isfinite(e_lo) and e_hi > 0.0:
            f_lo, f_hi = math.log(e_lo) - goal, math.log(e_hi) - goal
            if f_lo != f_hi:
                xi = x_lo + (x_hi - x_lo) * f_lo / (f_lo - f_hi)
                width = x_hi - x_lo
                x = min(max(xi, x_lo + 0.02 * width), x_hi - 0.02 * width)
        sigma = math.exp(x)
        e = eps(sigma)
        if ok(e):
            return sigma
        if e > te:
            lo, e_lo = sigma, e
        else:
            hi, e_hi = sigma, e
        if hi / lo - 1.0 < 1e-12:
            break
    return hi  # conservative; only reached if epsilon(sigma) jumps across the window
