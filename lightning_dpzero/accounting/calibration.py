"""Noise calibration: the smallest-ish noise multiplier that meets a target epsilon.

Epsilon of ``steps`` Poisson-subsampled Gaussian steps is :func:`~.accountants.compute_epsilon` (PLD, or
RDP where that is smaller; or RDP alone), which decreases with sigma. Sigma is bracketed with the cheap RDP
bound first (the reported epsilon is never above RDP's, so the sigma where RDP meets the target is enough
noise), then found by a safeguarded regula falsi on (log sigma, log epsilon) with the reported epsilon
itself, so the answer is *conservative* (epsilon(sigma) <= target, as the ledger will compute it) and
*tight* (epsilon(sigma) >= target * (1 - rtol)).

Two kinds of target are met by every noise multiplier; they are accepted with a warning on rank 0 and the
smallest multiplier searched, ``SIGMA_MIN``, is returned:

* delta >= 1 - (1 - q)^steps, the probability that a given example is used in any step: then the run is
  (0, delta)-DP whatever the noise (the two output distributions differ only when that example is sampled),
  so any target holds -- and the guarantee says nothing, since delta allows releasing the examples used;
* epsilon(SIGMA_MIN) <= target: even the least noise searched is private enough.
"""

from __future__ import annotations

import math

from .accountants import _check_accountant, _check_delta, _epsilon_of_runs, probability_ever_sampled
from .rdp import COARSE_ORDERS, rdp_epsilon
from .truncation import truncation_share

#: Search range for sigma. Below the floor no training is private in any useful sense; above the
#: ceiling no realistic target needs more noise.
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
                accountant: str = "pld", truncation: float = 0.0) -> float:
    """Epsilon (nats) of ``steps`` Poisson-subsampled Gaussian steps with sample rate q =
    ``sample_rate`` in (0, 1] and noise multiplier sigma = ``noise_multiplier`` >= 0, at ``delta``
    in (0, 1), by ``accountant`` ("pld" default, or "rdp"): :func:`compute_epsilon` of that one run.
    ``truncation``: p(T), the bound on the probability that bounded micro-batches truncate a draw in the
    ``steps`` (``MicroBatchBound.exceed_probability(q) * steps``; 0: no bound), taken from δ as
    :mod:`.truncation` says. ``math.inf`` for sigma == 0.

    Raises ValueError naming the bad argument."""
    delta, q, steps = _check_common(delta, sample_rate, steps)
    _check_accountant(accountant)
    s = float(noise_multiplier)
    if not (s >= 0.0 and math.isfinite(s)):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}.")
    return _epsilon_of_runs(((q, s, steps),), delta, accountant, float(truncation))


def rank_zero_warn(message: str) -> None:
    """Lightning's ``rank_zero_warn``, imported when a warning is due: the accounting (``lightning-dpzero
    ledger``/``plan``) does not import Lightning otherwise."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn as warn

    warn(message, stacklevel=3)


def _met_at_minimum(te: float, e_min: float, q: float, steps: int, delta: float) -> float:
    rank_zero_warn(
        f"target_epsilon={te:g} is met even by the least noise searched: noise_multiplier={SIGMA_MIN} gives "
        f"epsilon <= {e_min:.4g} for q={q:g}, steps={steps}, delta={delta:g}. Using noise_multiplier={SIGMA_MIN}; "
        "pass a smaller one explicitly if you need less noise.")
    return SIGMA_MIN


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                               accountant: str = "pld", rtol: float = 0.01, truncation: float = 0.0) -> float:
    """Noise multiplier sigma with ``target_epsilon * (1 - rtol) <= epsilon(sigma) <= target_epsilon``.

    Args:
        target_epsilon: epsilon to reach (nats), > 0.
        delta: delta in (0, 1).
        sample_rate: Poisson sample rate q in (0, 1] (expected batch size / dataset size).
        steps: number of optimizer steps, >= 1.
        accountant: "pld" (default, tight) or "rdp".
        rtol: relative tolerance in (0, 1) below the target (default 0.01; the search stops in the upper
            half of that window, so the noise is within a fraction of a percent of the least that works).
        truncation: p(T) of bounded micro-batches over the ``steps`` (see :func:`epsilon_for`; default 0).

    Returns:
        sigma (float): epsilon(sigma) as :func:`epsilon_for` computes it is at most the target. When every
        sigma meets the target (delta >= the probability that an example is ever sampled, or epsilon at
        ``SIGMA_MIN`` already within it), ``SIGMA_MIN`` with a warning on rank 0 saying why.

    Raises:
        ValueError: naming the argument and the fix for invalid inputs, and when the target cannot be met
            with sigma <= SIGMA_MAX.

    Example::

        >>> from lightning_dpzero.accounting import calibrate_noise_multiplier, epsilon_for
        >>> sigma = calibrate_noise_multiplier(8.0, 1e-5, 0.01, 1000)
        >>> 8.0 * 0.99 <= epsilon_for(sigma, 1e-5, 0.01, 1000) <= 8.0
        True
    """
    te = float(target_epsilon)
    if not (te > 0.0 and math.isfinite(te)):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}; "
                         "pass e.g. 8.0 (epsilon = 0 would need infinite noise).")
    delta, q, steps = _check_common(delta, sample_rate, steps)
    _check_accountant(accountant)
    if not 0.0 < float(rtol) < 1.0:
        raise ValueError(f"rtol must be in (0, 1), got {rtol!r}; the default 0.01 means within 1 %.")
    rtol = float(rtol)
    p = float(truncation)
    # the δ left to the untruncated steps at ε = target; the RDP guide below is evaluated there
    rest = delta - truncation_share(te, p)
    if rest <= 0:
        raise ValueError(f"the bounded micro-batches' truncation takes (1 + e^ε)·p = {truncation_share(te, p):.3g} "
                         f">= delta={delta:g} at target_epsilon={te:g}: raise max_micro_batch_size.")
    used = probability_ever_sampled(((q, 1.0, steps),))
    if used * (1 + 1e-12) <= delta - 2 * p:
        rank_zero_warn(
            f"target_epsilon={te:g} is met by any noise multiplier: delta={delta:g} is at least the probability "
            f"{used:.3g} = 1 - (1 - q)^steps that a given example is used in any of the {steps} steps (q={q:g}), "
            f"so the run is (0, delta)-DP even without noise, and the guarantee allows releasing the examples "
            f"that are used. Using noise_multiplier={SIGMA_MIN} (the least searched). Choose delta well below "
            f"1/N and below that probability for a meaningful guarantee.")
        return SIGMA_MIN

    def eps(sigma: float) -> float:
        return _epsilon_of_runs(((q, sigma, steps),), delta, accountant, p)

    # The coarse-order RDP bound costs about 2 ms per sigma and is never below the reported epsilon (which
    # is at most the default-order RDP bound); its shape guides the search, so that few of the reported
    # epsilons (each a PLD grid choice and composition) are needed.
    def rdp(sigma: float) -> float:
        return rdp_epsilon(((q, sigma, steps),), rest, COARSE_ORDERS)

    def rdp_solve(value: float) -> float:
        """The sigma (within 0.1 %) at which the RDP bound equals ``value``: decreasing in sigma."""
        a, b = SIGMA_MIN, SIGMA_MAX
        while b / a > 1.001:
            mid = math.sqrt(a * b)
            a, b = (mid, b) if rdp(mid) > value else (a, mid)
        return b

    if rdp(SIGMA_MIN) <= te:  # epsilon(SIGMA_MIN) is at most this bound
        return _met_at_minimum(te, rdp(SIGMA_MIN), q, steps, delta)
    if rdp(SIGMA_MAX) > te:
        e_max = eps(SIGMA_MAX)
        if e_max > te:
            raise ValueError(f"target_epsilon={te:g} needs sigma > {SIGMA_MAX:g} for q={q:g}, steps={steps}, "
                             f"delta={delta:g} (epsilon={e_max:.4g} at sigma={SIGMA_MAX:g}): raise target_epsilon "
                             "or delta, or lower sample_rate or steps.")
        hi, e_hi = SIGMA_MAX, e_max
    else:
        hi = rdp_solve(te)  # rdp(hi) <= te, hence eps(hi) <= te
        e_hi = eps(hi)
        while e_hi > te and hi < SIGMA_MAX:  # not expected (the reported epsilon is at most RDP's)
            hi = min(hi * 1.2, SIGMA_MAX)
            e_hi = eps(hi)
    low_goal = te * (1.0 - rtol / 2.0)
    goal = te * (1.0 - rtol / 4.0)

    def ok(e: float) -> bool:
        return low_goal <= e <= te

    if ok(e_hi):
        return hi
    # Secant on (log sigma, log eps) towards the goal, the first step in the RDP bound's shape (assuming
    # eps / rdp stays as at hi, but by at most a factor 1.3), kept inside the bracket [lo, hi] once a lower
    # end (eps > target) is known, and a bisection step whenever two steps have not halved the bracket.
    lo = None
    points = [(math.log(hi), math.log(e_hi))] if e_hi > 0 else []
    widths = []
    for _ in range(100):
        if len(points) >= 2 and points[-1][1] != points[-2][1]:
            (x0, y0), (x1, y1) = points[-2:]
            x = x1 + (math.log(goal) - y1) * (x1 - x0) / (y1 - y0)
        else:
            x = max(math.log(rdp_solve(goal * rdp(hi) / e_hi)) if e_hi > 0 else -math.inf, math.log(hi / 1.3))
        if lo is None:
            x = min(x, math.log(hi / 1.1))
        else:
            x_lo, x_hi = math.log(lo), math.log(hi)
            width = x_hi - x_lo
            widths.append(width)
            if len(widths) >= 3 and widths[-1] > 0.5 * widths[-3]:
                x, widths = 0.5 * (x_lo + x_hi), []
            else:
                x = min(max(x, x_lo + 0.01 * width), x_hi - 0.01 * width)
        sigma = max(math.exp(x), SIGMA_MIN)
        e = eps(sigma)
        if ok(e):
            return sigma
        if e > te:
            lo = sigma
        else:
            if sigma <= SIGMA_MIN:
                return _met_at_minimum(te, e, q, steps, delta)
            hi, e_hi = sigma, e
        if 0 < e < math.inf:  # inf: the truncation's share has no ε at this σ (a lower end, no secant point)
            points.append((math.log(sigma), math.log(e)))
        # epsilon jumps slightly where the PLD grid changes with sigma; stop once the bracket is tight
        if lo is not None and hi / lo - 1.0 < 1e-6 and e_hi >= te * (1.0 - rtol):
            break
    return hi  # conservative: epsilon(hi) <= target
