"""The privacy budget: may one more step (q, sigma) be charged without epsilon exceeding a target?

Used by :class:`~lightning_dpzero.PrivacyAccountantCallback` before every optimizer step. Epsilon is the
ledger's (``PrivacyLedger.epsilon()``, see :mod:`.accountants`) *with the next step charged*. The question is
answered cheaply:

1. the :class:`~.accountants.EpsilonTracker` upper bound (cached at a grid of step counts) -- if the bound
   is within the target, the ledger's epsilon is too;
2. only when the bound is over the target: the largest step count of the growing run that keeps the
   ledger's epsilon within the target is found once by bisection on that epsilon (about log2 of 2 % of the
   steps evaluations) and cached, so every later question is a comparison.

The answer is exact: a step is allowed if and only if the ledger's epsilon after charging it is at most the
target. This relies, like the tracker, on that epsilon being non-decreasing in the number of composed steps
(the PLD grid does not depend on it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .accountants import (EpsilonTracker, _as_runs, _check_accountant, _check_delta, _epsilon_of_runs,
                          truncation_probability)
from .banded import equivalent_run
from .ledger import LedgerEntry
from .truncation import MicroBatchBound, step_probability


class PrivacyBudgetExceeded(RuntimeError):
    """Charging the next optimizer step would make epsilon exceed the run's ``target_epsilon``."""


@dataclass
class _Hypothetical:
    """A ledger-like view (what ``EpsilonTracker.epsilon`` reads): entries, delta, accountant."""

    entries: list
    delta: float
    accountant: str


class BudgetGuard:
    """Answers "does the ledger stay within ``target_epsilon`` after one more step (q, sigma)?".

    Args:
        target_epsilon: the budget, > 0.
        tracker: the :class:`EpsilonTracker` whose upper bounds are tried first (shared with the caller's
            logging, so the same grid evaluations serve both); a new one if None.

    Methods take the ledger (``entries``, ``delta``, ``accountant``) and the next step's (q, sigma, sampler,
    bound), as :meth:`PrivacyLedger.charge` would record it (``bound``: bounded micro-batches, whose truncation
    the epsilon includes; None: none).
    """

    def __init__(self, target_epsilon: float, tracker: Optional[EpsilonTracker] = None):
        target_epsilon = float(target_epsilon)
        if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
            raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}.")
        self.target_epsilon = target_epsilon
        self.tracker = tracker if tracker is not None else EpsilonTracker()
        self._limits: dict = {}   # (prefix runs, q, sigma, delta, accountant) -> largest allowed count
        self._limit_eps: dict = {}  # same key -> the ledger's epsilon at that count (<= target)
        self.exact_evaluations = 0

    # ------------------------------------------------------------------------------------------ helpers
    @staticmethod
    def _split(ledger, q: float, sigma: float, sampler: str, bound: Optional[MicroBatchBound]):
        """(prefix entries, count of the growing run after the next step), as ``ledger.charge`` would merge."""
        entries = list(ledger.entries)
        last = entries[-1] if entries else None
        if last is not None and (last.sample_rate, last.noise_multiplier, last.sampler,
                                 getattr(last, "micro_batch_bound", None)) == (q, sigma, sampler, bound):
            return tuple(entries[:-1]), last.steps + 1
        return tuple(entries), 1

    def _exact(self, key, n: int) -> float:
        prefix, q, sigma, delta, accountant, p_prefix, tail, sampler = key
        self.exact_evaluations += 1
        runs = prefix + (equivalent_run(q, sigma, n, sampler),) if n > 0 else prefix
        return _epsilon_of_runs(runs, delta, accountant, p_prefix + n * tail)

    def _bound(self, entries: tuple, q: float, sigma: float, sampler: str, bound, n: int, delta: float,
               accountant: str) -> float:
        grown = list(entries) + [LedgerEntry.of(q, sigma, n, sampler, bound)]
        return self.tracker.epsilon(_Hypothetical(grown, delta, accountant))

    def _find_limit(self, key, n_next) -> int:
        """Largest count m of the growing run with epsilon(prefix + m steps) <= target, knowing that
        epsilon at the tracker grid point g >= n_next is over the target (so m < g); cached under ``key``."""
        target = self.target_epsilon
        g = self.tracker.grid_point(n_next)
        e0 = self._exact(key, 0)
        if e0 > target:  # the ledger is already over budget: no step of this run is allowed
            self._limits[key], self._limit_eps[key] = 0, e0
            return 0
        lo, hi, e_lo = 0, g, e0  # invariant: eps(lo) = e_lo <= target < eps(hi)
        if n_next - 1 > 0:
            e = self._exact(key, n_next - 1)
            if e <= target:
                lo, e_lo = n_next - 1, e
            else:
                hi = n_next - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            e = self._exact(key, mid)
            if e <= target:
                lo, e_lo = mid, e
            else:
                hi = mid
        self._limits[key], self._limit_eps[key] = lo, e_lo
        return lo

    def _key(self, ledger, sample_rate, noise_multiplier, sampler, bound):
        """``((prefix runs, q, sigma, delta, accountant, p of the prefix, per-step p of the growing run), n_next,
        prefix entries)``; the key is ``None`` when epsilon is infinite."""
        q, sigma = float(sample_rate), float(noise_multiplier)
        delta, accountant = _check_delta(ledger.delta), _check_accountant(ledger.accountant)
        entries, n_next = self._split(ledger, q, sigma, sampler, bound)
        prefix = _as_runs(entries)
        if sigma == 0.0 or any(s == 0.0 for _, s, _ in prefix):
            return None, n_next, entries
        tail = step_probability(bound, q)
        return ((prefix, q, sigma, delta, accountant, truncation_probability(entries), tail, sampler), n_next,
                entries)

    # ------------------------------------------------------------------------------------------ API
    def allows_next_step(self, ledger, sample_rate: float, noise_multiplier: float,
                         sampler: str = "poisson", bound: Optional[MicroBatchBound] = None) -> bool:
        """True iff the epsilon of ``ledger`` with one more step (q, sigma) charged is <= target."""
        key, n_next, entries = self._key(ledger, sample_rate, noise_multiplier, sampler, bound)
        if key is None:
            return False  # epsilon is infinite
        _, q, sigma, delta, accountant, _, _, _ = key
        limit = self._limits.get(key)
        if limit is not None:
            return n_next <= limit
        if self._bound(entries, q, sigma, sampler, bound, n_next, delta, accountant) <= self.target_epsilon:
            return True
        return n_next <= self._find_limit(key, n_next)

    def epsilon_after_next_step(self, ledger, sample_rate: float, noise_multiplier: float,
                                sampler: str = "poisson", bound: Optional[MicroBatchBound] = None) -> float:
        """The epsilon of ``ledger`` with one more step (q, sigma) charged (``inf`` for sigma = 0)."""
        key, n_next, _ = self._key(ledger, sample_rate, noise_multiplier, sampler, bound)
        if key is None:
            return math.inf
        return self._exact(key, n_next)

    def steps_within_budget(self, ledger, sample_rate: float, noise_multiplier: float,
                            sampler: str = "poisson", bound: Optional[MicroBatchBound] = None) -> int:
        """How many more steps (q, sigma) can be charged to ``ledger`` with epsilon staying <= target."""
        key, n_next, entries = self._key(ledger, sample_rate, noise_multiplier, sampler, bound)
        if key is None:
            return 0
        _, q, sigma, delta, accountant, _, _, _ = key
        limit = self._limits.get(key)
        if limit is None:
            # grow a bracket on the tracker grid until its (grid-point) value is over the target
            n = n_next
            while self._bound(entries, q, sigma, sampler, bound, n, delta, accountant) <= self.target_epsilon:
                n = max(n + 1, self.tracker.grid_point(int(n * 1.5) + 1))
                if n > 10**9:
                    raise ValueError("more than 1e9 steps fit in the budget; is the noise multiplier sensible?")
            limit = self._find_limit(key, n)
        return max(limit - (n_next - 1), 0)

    def epsilon_upper_bound(self, ledger) -> float:
        """An upper bound on the ledger's epsilon that never exceeds the target while the ledger is
        within it: the tracker's bound, tightened to the ledger's epsilon at the largest step count that fits
        once that count is known (epsilon is non-decreasing in steps). This is what gets logged, so a run
        stopped by the budget never shows an epsilon above its target."""
        delta, accountant = _check_delta(ledger.delta), _check_accountant(ledger.accountant)
        entries = [e for e in ledger.entries if int(e.steps)]
        if not entries:
            return 0.0
        found = self.tracker.epsilon(ledger)
        last = entries[-1]  # the growing run, in charged steps as the limits count them (not its equivalent run)
        q, sigma, n = float(last.sample_rate), float(last.noise_multiplier), int(last.steps)
        tail = step_probability(getattr(last, "micro_batch_bound", None), q)
        key = (_as_runs(entries[:-1]), q, sigma, delta, accountant, truncation_probability(entries[:-1]), tail,
               getattr(last, "sampler", "poisson"))
        limit = self._limits.get(key)
        if limit is not None and n <= limit:
            return min(found, self._limit_eps[key])
        return found
