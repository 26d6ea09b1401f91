"""Bounded micro-batches: what truncating an oversized Poisson draw costs in δ.

A Poisson sample is random in size. With ``max_micro_batch_size = b`` and K micro-batches per optimizer step,
the sampler keeps a uniformly random subset of ``K·b`` of a rank's step sample when it drew more (so every
micro-batch holds at most b examples). That changes the mechanism only on the event E that, at some step, some
rank drew more than ``K·b`` examples.

Coupling the truncated run M' with the untruncated M (the same draws), the two outputs differ only on E, so
``TV(M'(D), M(D)) <= P[E] <= p(T)`` for every dataset D, with the union bound over steps and ranks

    p(T) = Σ_steps Σ_r P[Binomial(n_r + 1, q) > K·b],

``n_r`` the examples of rank r (``+ 1`` for the neighbouring dataset with one more example; a larger n only
makes the tail larger, so this holds for both directions of add-or-remove-one adjacency). Then:

    if M is (ε, δ')-DP and TV(M'(D), M(D)) <= p for every D, M' is (ε, δ' + (1 + e^ε)·p)-DP,

since P[M'(D) ∈ S] <= P[M(D) ∈ S] + p <= e^ε P[M(D') ∈ S] + δ' + p <= e^ε (P[M'(D') ∈ S] + p) + δ' + p. The
reported ε at δ is therefore the smallest ε found with ``ε >= ε_M(δ - (1 + e^ε)·p(T))``, ``ε_M`` the
accountant's ε of the untruncated composition (PLD or RDP): :func:`epsilon_with_truncation`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from scipy.stats import binom

__all__ = ["MicroBatchBound", "check_max_micro_batch_size", "check_fixed_size_bound", "exceed_probability",
           "step_probability", "bound_fields", "epsilon_with_truncation", "truncation_share",
           "smallest_micro_batch_bound", "rank_sizes_of"]

#: the truncation's share (1 + e^ε)·p(T) of δ at the planned steps above which a plan is refused
MAX_SHARE = 0.5


@dataclass(frozen=True)
class MicroBatchBound:
    """At most ``max_micro_batch_size`` (b) examples per micro-batch, K = ``accumulate_grad_batches`` micro-batches
    per optimizer step, over ranks holding ``rank_sizes`` examples each (in rank order).

    Example:
        >>> bound = MicroBatchBound(8, 1, (50, 50))
        >>> round(bound.exceed_probability(0.05), 6)   # 2 P[Bin(51, 0.05) > 8]: expected 2.5 per rank and step
        0.001755
    """

    max_micro_batch_size: int
    accumulate_grad_batches: int
    rank_sizes: tuple

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank_sizes", tuple(int(n) for n in self.rank_sizes))
        for name in ("max_micro_batch_size", "accumulate_grad_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
            object.__setattr__(self, name, int(value))
        if not self.rank_sizes or min(self.rank_sizes) < 1:
            raise ValueError(f"rank_sizes must be sizes >= 1, one per rank, got {list(self.rank_sizes)!r}.")

    def exceed_probability(self, sample_rate: float) -> float:
        """Per optimizer step: Σ_r P[Binomial(n_r + 1, q) > K·b], an upper bound on the probability that some
        rank's step sample is truncated (on either of two neighbouring datasets)."""
        return exceed_probability(float(sample_rate), self.max_micro_batch_size * self.accumulate_grad_batches,
                                  self.rank_sizes)


@functools.lru_cache(maxsize=1024)
def exceed_probability(sample_rate: float, cap: int, rank_sizes: tuple) -> float:
    """Σ_r P[Binomial(n_r + 1, q) > cap] in float64 (``scipy.stats.binom.sf``, exact tails, no cancellation)."""
    return float(sum(binom.sf(cap, n + 1, sample_rate) for n in rank_sizes))


def step_probability(bound: Optional[MicroBatchBound], sample_rate: float) -> float:
    """Per optimizer step, the bound on the probability that ``bound`` truncates a draw at q = ``sample_rate``
    (:meth:`MicroBatchBound.exceed_probability`); 0.0 without a bound."""
    return 0.0 if bound is None else bound.exceed_probability(sample_rate)


def bound_fields(bound: Optional[MicroBatchBound]) -> tuple:
    """``(b, K, rank sizes)`` of ``bound``, or three None: the fields a ledger entry and a plan tuple carry."""
    if bound is None:
        return (None, None, None)
    return (bound.max_micro_batch_size, bound.accumulate_grad_batches, bound.rank_sizes)


def check_max_micro_batch_size(value) -> Optional[int]:
    """``value`` as an int, or None (unbounded); ``ValueError`` unless an integer >= 1 (the one check of the
    strategies' and the planner's ``max_micro_batch_size``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_micro_batch_size must be an integer >= 1 (the most examples one micro-batch may "
                         f"hold) or None (unbounded), got {value!r}.")
    return int(value)


def check_fixed_size_bound(max_micro_batch_size: Optional[int], batch_size: int,
                           name: str = "the DataLoader's batch_size") -> None:
    """With fixed-size (shuffled) batches every micro-batch holds ``batch_size`` (called ``name`` in the
    message): a smaller b is refused (``ValueError``), any other b bounds nothing (the one check of the sampler
    and the planner)."""
    if max_micro_batch_size is not None and max_micro_batch_size < batch_size:
        raise ValueError(f"max_micro_batch_size={max_micro_batch_size} is below {name}={batch_size}, which "
                         "poisson_sampling=False puts in every micro-batch: lower the DataLoader's batch_size, or "
                         "raise max_micro_batch_size (with fixed-size batches it bounds nothing else).")


def rank_sizes_of(dataset_size: int, world_size: int, shard_sizes: Optional[Sequence[int]] = None) -> tuple:
    """Examples per rank: ``shard_sizes`` when pre-sharded, else the DP sampler's r, r+W, ... split of N."""
    if shard_sizes is not None:
        return tuple(int(n) for n in shard_sizes)
    return tuple(len(range(r, int(dataset_size), int(world_size))) for r in range(int(world_size)))


def epsilon_with_truncation(epsilon_at: Callable[[float], float], delta: float, p: float) -> float:
    """The smallest ε this search finds with ``epsilon_at(δ - (1 + e^ε)·p) <= ε``: then the untruncated run is
    (ε, δ - (1 + e^ε) p)-DP and the truncated one (ε, δ)-DP (module docstring). ``epsilon_at(d)`` is the
    accountant's ε of the untruncated composition at δ = d, non-increasing in d.

    A fixed-point iteration from below (ε_{k+1} = epsilon_at(δ - (1 + e^{ε_k}) p), increasing towards the least
    fixed point), then a certificate: u slightly above the limit with ε = epsilon_at(δ - (1 + e^u) p) <= u, which
    makes ε valid (its own share (1 + e^ε) p is at most u's). ``math.inf`` when no such ε exists (p takes δ).
    """
    if p <= 0.0:
        return epsilon_at(delta)
    if 2.0 * p >= delta:
        return math.inf

    def at(u: float) -> float:
        rest = delta - (1.0 + math.exp(u)) * p if u < 700 else -math.inf
        return epsilon_at(rest) if rest > 0 else math.inf

    eps = at(0.0)
    for _ in range(50):
        nxt = at(eps)
        if not math.isfinite(nxt) or nxt <= eps * (1 + 1e-9):
            eps = max(eps, nxt)
            break
        eps = nxt
    if not math.isfinite(eps):
        return math.inf
    margin = 1e-6
    while margin < 1.0:
        u = eps * (1 + margin) + margin
        found = at(u)
        if found <= u:
            return found
        margin *= 10
    return math.inf


def truncation_share(epsilon: float, p: float) -> float:
    """(1 + e^ε)·p: the part of δ the truncation takes at ε (``math.inf`` for an infinite ε and p > 0)."""
    if p <= 0.0:
        return 0.0
    return math.inf if epsilon > 700 else (1.0 + math.exp(epsilon)) * p


def smallest_micro_batch_bound(sample_rate: float, accumulate_grad_batches: int, rank_sizes: Sequence[int],
                               steps: int, delta: float, epsilon: float, share: float = MAX_SHARE) -> int:
    """The smallest b with (1 + e^ε)·steps·Σ_r P[Bin(n_r + 1, q) > K·b] <= share·δ (bisection: the tail falls
    as b grows, and is 0 once K·b >= max n_r + 1)."""
    sizes = tuple(int(n) for n in rank_sizes)
    k = int(accumulate_grad_batches)

    def fits(b: int) -> bool:
        return truncation_share(epsilon, steps * exceed_probability(sample_rate, b * k, sizes)) <= share * delta

    lo, hi = 0, max(1, -(-(max(sizes) + 1) // k))  # fits(hi): no rank can draw more than K·hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi
