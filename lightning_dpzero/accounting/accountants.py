"""Epsilon from a privacy ledger, computed by Google's ``dp-accounting`` library.

Every step of DP-SGD is one Poisson-subsampled Gaussian mechanism: sample rate ``q`` (probability that
an example is in the step's batch) and noise multiplier ``sigma`` (noise std / clipping norm). A ledger
is an ordered list of runs ``(q, sigma, steps)``; its epsilon at a given delta is that of the
composition of all runs, in order, under add-or-remove-one adjacency.

Accountants (no privacy math is written here; all of it is ``dp_accounting``'s):

* ``"pld"`` (default, tight): privacy loss distributions -- Koskela, Jalko & Honkela (AISTATS 2020),
  "Computing tight differential privacy guarantees using FFT"; Doroshenko, Ghazi, Kamath, Kumar &
  Manurangsi (PETS 2022), "Connect the dots: tighter discrete approximations of privacy loss
  distributions". Pessimistic discretisation, so the result is an upper bound on the true epsilon.
* ``"rdp"``: Renyi DP -- Mironov (CSF 2017), "Renyi differential privacy"; Mironov, Talwar & Zhang
  (2019) for the subsampled Gaussian. Looser than PLD, also an upper bound.

The PLD path composes ``dp_accounting.pld.privacy_loss_distribution`` objects in exactly the order
``dp_accounting.pld.PLDAccountant`` does (identity, then each run's one-step PLD self-composed
``steps`` times), so its numbers are bit-identical to a ``PLDAccountant`` fed the same events; it only
adds caches of the one-step PLDs and of composed prefixes, which is what makes per-step tracking cheap.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Iterable

import dp_accounting
from dp_accounting.pld import privacy_loss_distribution as _pld

ACCOUNTANTS = ("pld", "rdp")

#: Width of the PLD privacy-loss grid (nats). 1e-3 keeps the PLD epsilon within ~0.1 % of the
#: 1e-4 library default up to 1e5 steps (and below RDP everywhere we checked) at ~10x the speed.
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-3

Run = tuple  # (sample_rate: float, noise_multiplier: float, steps: int)


def _check_accountant(name: str) -> str:
    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS!r}, got {name!r}.")
    return name


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}; use e.g. 1/N**1.1 for N examples.")
    return delta


def make_accountant(name: str = "pld",
                    value_discretization_interval: float = PLD_VALUE_DISCRETIZATION_INTERVAL
                    ) -> dp_accounting.PrivacyAccountant:
    """A fresh ``dp_accounting`` accountant: ``"pld"`` -> ``PLDAccountant`` (with the package's
    discretisation interval, in nats), ``"rdp"`` -> ``RdpAccountant`` (library default orders).

    Raises ValueError naming the allowed values for any other name."""
    _check_accountant(name)
    if name == "pld":
        return dp_accounting.pld.PLDAccountant(
            value_discretization_interval=value_discretization_interval)
    return dp_accounting.rdp.RdpAccountant()


def _as_runs(entries: Iterable) -> tuple:
    """Validated ``(q, sigma, steps)`` tuples from objects with ``sample_rate``, ``noise_multiplier``
    and ``steps`` attributes (e.g. ``LedgerEntry``); runs with zero steps are dropped."""
    runs = []
    for e in entries:
        q, s, n = float(e.sample_rate), float(e.noise_multiplier), int(e.steps)
        if not 0.0 < q <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {q!r}.")
        if not (s >= 0.0 and math.isfinite(s)):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {s!r}.")
        if n < 0:
            raise ValueError(f"steps must be >= 0, got {n!r}.")
        if n:
            runs.append((q, s, n))
    return tuple(runs)


class _LRU:
    """A small thread-safe LRU map (PLD objects can be megabytes; keep few)."""

    def __init__(self, maxsize: int):
        self.maxsize, self._d, self._lock = maxsize, OrderedDict(), threading.Lock()

    def get(self, key):
        with self._lock:
            if key in self._d:
                self._d.move_to_end(key)
                return self._d[key]
        return None

    def put(self, key, value):
        with self._lock:
            self._d[key] = value
            self._d.move_to_end(key)
            while len(self._d) > self.maxsize:
                self._d.popitem(last=False)
        return value


_BASE_PLDS = _LRU(64)     # (q, sigma, h) -> one-step PLD
_PREFIX_PLDS = _LRU(16)   # (runs, h) -> composed PLD of those runs


def _base_pld(q: float, sigma: float, h: float):
    key = (q, sigma, h)
    pld = _BASE_PLDS.get(key)
    if pld is None:
        # Same call as dp_accounting.pld.PLDAccountant for PoissonSampledDpEvent(q, GaussianDpEvent(s)).
        pld = _BASE_PLDS.put(key, _pld.from_gaussian_mechanism(
            standard_deviation=sigma, sampling_prob=q, value_discretization_interval=h,
            neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE))
    return pld


def _run_pld(run: Run, h: float):
    q, s, n = run
    return _base_pld(q, s, h).self_compose(n)


def _composed_pld(runs: tuple, h: float):
    """PLD of ``runs`` composed in order, starting from the identity as PLDAccountant does."""
    if not runs:
        return _pld.identity(value_discretization_interval=h)
    cached = _PREFIX_PLDS.get((runs, h))
    if cached is not None:
        return cached
    start = _PREFIX_PLDS.get((runs[:-1], h))
    if start is not None:
        pld, rest = start, runs[-1:]
    else:
        pld, rest = _pld.identity(value_discretization_interval=h), runs
    for run in rest:
        pld = pld.compose(_run_pld(run, h))
    return _PREFIX_PLDS.put((runs, h), pld)


def _epsilon_of_runs(runs: tuple, delta: float, accountant: str, h: float) -> float:
    if not runs:
        return 0.0
    if any(s == 0.0 for _, s, _ in runs):
        return math.inf
    if accountant == "rdp":
        acc = dp_accounting.rdp.RdpAccountant()
        for q, s, n in runs:
            acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), n)
        return float(acc.get_epsilon(delta))
    pld = _composed_pld(runs[:-1], h).compose(_run_pld(runs[-1], h))
    return float(pld.get_epsilon_for_delta(delta))


def compute_epsilon(entries: Iterable, delta: float, accountant: str = "pld",
                    value_discretization_interval: float = PLD_VALUE_DISCRETIZATION_INTERVAL) -> float:
    """Exact epsilon (as computed by dp-accounting) of the ordered composition of ``entries``.

    Args:
        entries: runs with ``sample_rate`` q in (0, 1], ``noise_multiplier`` sigma >= 0 and ``steps``
            >= 0, each run meaning ``steps`` Poisson-subsampled Gaussian steps
            (``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)``).
        delta: target delta in (0, 1).
        accountant: ``"pld"`` (default) or ``"rdp"``.
        value_discretization_interval: PLD grid width in nats (ignored for RDP).

    Returns epsilon (float, nats); ``0.0`` for no steps; ``math.inf`` if any run with steps has
    sigma == 0. Raises ValueError on an unknown accountant, delta outside (0, 1) or an invalid run.
    """
    _check_accountant(accountant)
    return _epsilon_of_runs(_as_runs(entries), _check_delta(delta), accountant,
                            float(value_discretization_interval))


class EpsilonTracker:
    """Incremental epsilon for a growing ledger: cheap per step, never an under-statement.

    ``tracker.epsilon(ledger)`` may be called after every step. The last run of the ledger is the one
    that grows; with the earlier runs fixed, epsilon is non-decreasing in the last run's step count n
    (composing one more mechanism cannot lower it). The tracker therefore evaluates, with dp-accounting,
    the exact epsilon at n' = ``grid_point(n)`` >= n, where the grid is every integer up to
    ``exact_below`` and then ``ceil(exact_below * growth**k)``, and caches it. Guarantee:

        compute_epsilon(ledger) <= tracker.epsilon(ledger) <= epsilon with the last run at n' steps,

    with equality whenever n is a grid point. Since n' < growth * n + 1, the over-statement is that of
    at most ~2 % more steps: measured <= 1.8 % in epsilon (q in [1e-3, 0.2], n <= 1e5), ~0.2 % at
    1e5 steps. ``exact=True`` returns the exact value
    (use it at checkpoints, at the end and for anything published). Each grid point costs one PLD
    self-composition (~5-40 ms; the one-step PLD and the earlier runs' composition are cached), and a
    ledger of 1e5 steps has ~450 grid points, so the amortised cost is far below a millisecond.

    Args:
        growth: grid ratio, > 1 (default 1.02).
        exact_below: every step count up to this is a grid point (default 50).
        value_discretization_interval: PLD grid width in nats (default
            ``PLD_VALUE_DISCRETIZATION_INTERVAL``); the same value must be used for exact comparisons.
        max_cache: number of cached epsilons kept (oldest dropped first).
    """

    def __init__(self, growth: float = 1.02, exact_below: int = 50,
                 value_discretization_interval: float = PLD_VALUE_DISCRETIZATION_INTERVAL,
                 max_cache: int = 4096):
        if not growth > 1.0:
            raise ValueError(f"growth must be > 1, got {growth!r}.")
        if int(exact_below) < 1:
            raise ValueError(f"exact_below must be >= 1, got {exact_below!r}.")
        self.growth, self.exact_below = float(growth), int(exact_below)
        self.value_discretization_interval = float(value_discretization_interval)
        self._cache: OrderedDict = OrderedDict()
        self._max_cache = int(max_cache)
        self.evaluations = 0  # number of dp-accounting evaluations done (for diagnostics)

    def grid_point(self, steps: int) -> int:
        """Smallest grid step count >= ``steps`` (``steps`` itself up to ``exact_below``)."""
        steps, e = int(steps), self.exact_below
        if steps <= e:
            return steps
        k = max(0, int(math.floor(math.log(steps / e) / math.log(self.growth))) - 1)
        while math.ceil(e * self.growth ** k) < steps:
            k += 1
        return int(math.ceil(e * self.growth ** k))

    def epsilon(self, ledger, exact: bool = False, delta: float | None = None,
                accountant: str | None = None) -> float:
        """Epsilon of ``ledger`` (an upper bound on its exact value; exact when ``exact=True``).

        ``delta`` and ``accountant`` default to the ledger's own. Returns ``math.inf`` if any run
        has sigma == 0, ``0.0`` if there are no steps."""
        delta = _check_delta(ledger.delta if delta is None else delta)
        accountant = _check_accountant(ledger.accountant if accountant is None else accountant)
        runs = _as_runs(ledger.entries)
        if not runs:
            return 0.0
        if any(s == 0.0 for _, s, _ in runs):
            return math.inf
        q, s, n = runs[-1]
        n_eval = n if exact else self.grid_point(n)
        key = (accountant, delta, self.value_discretization_interval, runs[:-1], q, s, n_eval)
        eps = self._cache.get(key)
        if eps is None:
            eps = _epsilon_of_runs(runs[:-1] + ((q, s, n_eval),), delta, accountant,
                                   self.value_discretization_interval)
            self.evaluations += 1
            self._cache[key] = eps
            if len(self._cache) > self._max_cache:
                self._cache.popitem(last=False)
        return eps
