"""Epsilon of a privacy ledger: the tighter of two valid upper bounds computed with dp-accounting.

Every step of DP-SGD is one Poisson-subsampled Gaussian mechanism: sample rate ``q`` (probability that an
example is in the step's batch) and noise multiplier ``sigma`` (noise std / clipping norm). A ledger is an
ordered list of runs ``(q, sigma, steps)``; its epsilon at a given delta is that of the composition of all
runs, in order, under add-or-remove-one adjacency.

Accountants:

* ``"pld"`` (default): privacy loss distributions -- Koskela, Jalko & Honkela (AISTATS 2020), "Computing
  tight differential privacy guarantees using FFT"; Doroshenko, Ghazi, Kamath, Kumar & Manurangsi (PETS
  2022), "Connect the dots: tighter discrete approximations of privacy loss distributions". dp-accounting's
  pessimistic discretisation on a grid chosen per ledger (:mod:`.pld`), so the value is an upper bound on
  the true epsilon within about 1 % of it. The RDP bound below is computed too and reported instead when it
  is smaller (the minimum of two valid upper bounds is a valid upper bound); :func:`epsilon_bound` says which
  one gave the number.
* ``"rdp"``: Renyi DP -- Mironov (CSF 2017); Mironov, Talwar & Zhang (2019) for the subsampled Gaussian
  (:mod:`.rdp`). Looser than PLD, also an upper bound.

Shortcut: when delta >= 1 - prod (1 - q)^steps, the probability that a given example is used in any step,
the two output distributions differ by at most that much in total variation, so the ledger is (0, delta)-DP
and epsilon is 0 by either accountant.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Iterable, Optional, get_args

import dp_accounting

from ..util.options import Accountant
from . import pld as _pld
from .banded import equivalent_run, noise_scale
from .blt import blt_of
from .rdp import rdp_epsilon
from .truncation import epsilon_with_truncation, step_probability, truncation_share

ACCOUNTANTS = get_args(Accountant)  # ("pld", "rdp")

Run = tuple  # (sample_rate: float, noise_multiplier: float, steps: int)


def _check_accountant(name: str) -> str:
    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS!r}, got {name!r}.")
    return name


def _check_delta(delta: float) -> float:
    """``delta`` as a float; ``ValueError`` unless 0 < δ < 1 (the one check of δ in the package)."""
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}; typical is 1e-5 or below 1/N "
                         "(e.g. 1/N**1.1 for N examples).")
    return delta


def make_accountant(name: str = "pld", value_discretization_interval: float = 1e-4
                    ) -> dp_accounting.PrivacyAccountant:
    """A fresh ``dp_accounting`` accountant: ``"pld"`` -> ``PLDAccountant`` on a fixed grid
    (``value_discretization_interval`` nats, the library's default 1e-4), ``"rdp"`` -> ``RdpAccountant``
    (library default orders). For your own experiments; the package's epsilon is :func:`compute_epsilon`.

    Raises ValueError naming the allowed values for any other name."""
    _check_accountant(name)
    if name == "pld":
        return dp_accounting.pld.PLDAccountant(value_discretization_interval=value_discretization_interval)
    return dp_accounting.rdp.RdpAccountant()


def _as_runs(entries: Iterable) -> tuple:
    """Validated ``(q, sigma, steps)`` tuples from objects with ``sample_rate``, ``noise_multiplier``
    and ``steps`` attributes (e.g. ``LedgerEntry``); runs with zero steps are dropped. An entry whose ``sampler``
    is ``"cyclic-poisson:b"`` (banded matrix factorization) gives :func:`.banded.equivalent_run`'s run; the entries
    of one BLT stream (``"cyclic-blt:..."``) give one run, ``(1, σ / Δ, 1)``, where the stream first appears."""
    runs, blt_streams = [], {}
    for e in entries:
        q, s, n = float(e.sample_rate), float(e.noise_multiplier), int(e.steps)
        if not 0.0 < q <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {q!r}.")
        if not (s >= 0.0 and math.isfinite(s)):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {s!r}.")
        if n < 0:
            raise ValueError(f"steps must be >= 0, got {n!r}.")
        sampler = getattr(e, "sampler", "poisson")
        if n and blt_of(sampler) is not None:  # BLT: one Gaussian over its whole stream, filled in below
            if sampler not in blt_streams:
                blt_streams[sampler] = (len(runs), [])
                runs.append(None)
            blt_streams[sampler][1].append((n, s))
        elif n:  # correlated noise (sampler "cyclic-poisson:b"): its equivalent Poisson composition (banded.py)
            runs.append(equivalent_run(q, s, n, sampler))
    for sampler, (at, parts) in blt_streams.items():
        # one entry per stream is what the ledger writes; a ledger with several (written by hand) is taken at the
        # smallest σ and the larger of the two readings, one stream of Σ T_i steps or separate streams
        sigma = min(s for _, s in parts)
        whole = noise_scale(sampler, sum(n for n, _ in parts)) ** 2
        apart = sum(noise_scale(sampler, n) ** 2 for n, _ in parts)
        runs[at] = (1.0, sigma / math.sqrt(max(whole, apart)), 1)
    return tuple(runs)


def _exceed_probabilities(entries: Iterable) -> tuple:
    """Per step, the probability bound that a bounded micro-batch truncates a draw, for each run of
    :func:`_as_runs`, in its order (0.0 for an entry without ``micro_batch_bound``; docs/privacy.md, *Bounded
    micro-batches*)."""
    out, streams = [], set()
    for e in entries:
        sampler = getattr(e, "sampler", "poisson")
        if not int(e.steps) or (blt_of(sampler) is not None and sampler in streams):
            continue  # no run, or merged into its BLT stream's run
        streams.add(sampler)
        out.append(step_probability(getattr(e, "micro_batch_bound", None), e.sample_rate))
    return tuple(out)


def _truncation_of_runs(runs: tuple, tails: tuple) -> float:
    """Σ_runs steps · (per-step probability): p(T) of ``runs`` with :func:`_exceed_probabilities` ``tails``."""
    return float(sum(n * t for (_, _, n), t in zip(runs, tails)))


def truncation_probability(entries: Iterable) -> float:
    """p(T) = Σ_runs steps · P[some rank's step sample exceeds K·b]: the bound on the probability that a bounded
    micro-batch ever truncated a draw (0.0 when no entry has a bound)."""
    entries = list(entries)
    return _truncation_of_runs(_as_runs(entries), _exceed_probabilities(entries))


def probability_ever_sampled(runs: tuple) -> float:
    """1 - prod (1 - q)^steps over ``runs``: the chance that a given example is in at least one step."""
    if any(q >= 1.0 for q, _, _ in runs):
        return 1.0
    return -math.expm1(sum(n * math.log1p(-q) for q, _, n in runs))


@dataclass(frozen=True)
class EpsilonBound:
    """Epsilon of a ledger and where it comes from.

    Attributes:
        epsilon: the reported epsilon (nats): the smallest of the valid upper bounds computed for the
            whole ledger, but never less than the epsilon of the ledger without its last run.
        method: which bound gave it: ``"pld"``, ``"rdp"``, or ``"none"`` (no steps, or delta at least the
            probability that an example is ever used: epsilon = 0 exactly), ``"sigma=0"`` (infinite).
        pld: the PLD bound (None when ``accountant="rdp"`` or not needed).
        rdp: the RDP bound (None when not needed).
        value_discretization_interval: the PLD grid in nats (None without a PLD bound).
        truncation_delta: with bounded micro-batches, the part (1 + e^ε)·p(T) of δ the truncation takes (the
            bounds above are then those of the untruncated steps at δ minus it); None without a bound.
    """

    epsilon: float
    method: str
    pld: Optional[float] = None
    rdp: Optional[float] = None
    value_discretization_interval: Optional[float] = None
    truncation_delta: Optional[float] = None


def _bound_of_runs(runs: tuple, delta: float, accountant: str, h: Optional[float] = None) -> EpsilonBound:
    bound = _bound_of_composition(runs, delta, accountant, h)
    if len(runs) > 1 and h is None:
        # Appending a run whose grid is finer re-evaluates the earlier runs more tightly, which could report
        # less than before it started; the ledger without its last run is a valid bound too, so keep the
        # larger (epsilon then never decreases as steps are charged, across runs as within one).
        before = _prefix_bound(runs[:-1], delta, accountant)
        if before.epsilon > bound.epsilon:
            bound = replace(bound, epsilon=before.epsilon, method=before.method)
    return bound


@functools.lru_cache(maxsize=256)
def _prefix_bound(runs: tuple, delta: float, accountant: str) -> EpsilonBound:
    return _bound_of_runs(runs, delta, accountant)


def _bound_of_composition(runs: tuple, delta: float, accountant: str, h: Optional[float]) -> EpsilonBound:
    if not runs:
        return EpsilonBound(0.0, "none")
    if any(s == 0.0 for _, s, _ in runs):
        return EpsilonBound(math.inf, "sigma=0")
    if probability_ever_sampled(runs) * (1 + 1e-12) <= delta:  # margin for its round-off
        return EpsilonBound(0.0, "none")
    rdp = float(rdp_epsilon(runs, delta))
    if accountant == "rdp":
        return EpsilonBound(rdp, "rdp", rdp=rdp)
    h = _pld.value_discretization_interval(runs, delta) if h is None else float(h)
    pld = float(_pld.pld_epsilon(runs, delta, h))
    return EpsilonBound(min(pld, rdp), "pld" if pld <= rdp else "rdp", pld, rdp, h)


def _epsilon_of_runs(runs: tuple, delta: float, accountant: str, truncation: float = 0.0) -> float:
    return _truncated_bound(runs, delta, accountant, truncation).epsilon


def _truncated_bound(runs: tuple, delta: float, accountant: str, truncation: float = 0.0) -> EpsilonBound:
    """The bound of ``runs`` when a bounded micro-batch truncates a draw with probability at most
    ``truncation`` = p(T) over the whole run: the smallest ε found with ε >= ε(δ - (1 + e^ε)·p) by the
    accountant (:func:`~.truncation.epsilon_with_truncation`); :func:`_bound_of_runs` when p = 0."""
    if truncation <= 0.0 or not runs or any(s == 0.0 for _, s, _ in runs):
        return _bound_of_runs(runs, delta, accountant)
    last: list = []
    # one PLD grid, the one chosen at δ, for every δ the search tries: the composition is then computed once
    # (any grid gives an upper bound; this one is within about 1 % at δ, and δ changes little)
    h = _bound_of_runs(runs, delta, accountant).value_discretization_interval

    def at(d: float) -> float:
        last[:] = [_bound_of_runs(runs, d, accountant, h)]
        return last[0].epsilon

    eps = epsilon_with_truncation(at, delta, truncation)
    if not math.isfinite(eps) or not last:
        return EpsilonBound(math.inf, "truncation", truncation_delta=math.inf)
    return replace(last[0], epsilon=eps, truncation_delta=truncation_share(eps, truncation))


def epsilon_bound(entries: Iterable, delta: float, accountant: str = "pld",
                  value_discretization_interval: Optional[float] = None) -> EpsilonBound:
    """Epsilon of the ordered composition of ``entries`` with what produced it (see :func:`compute_epsilon`
    for the arguments); ``value_discretization_interval`` fixes the PLD grid (nats) instead of choosing it.

    Example::

        >>> from lightning_dpzero.accounting import LedgerEntry, epsilon_bound
        >>> b = epsilon_bound([LedgerEntry(0.01, 1.0, 1000)], delta=1e-5)
        >>> b.method, round(b.epsilon, 3)
        ('pld', 1.829)
    """
    _check_accountant(accountant)
    entries = list(entries)
    try:
        p = truncation_probability(entries)
        if p > 0.0:
            return _truncated_bound(_as_runs(entries), _check_delta(delta), accountant, p)
        return _bound_of_runs(_as_runs(entries), _check_delta(delta), accountant, value_discretization_interval)
    except (OverflowError, ZeroDivisionError, FloatingPointError, MemoryError) as exc:
        runs = ", ".join(f"(q={r[0]!r}, sigma={r[1]!r}, steps={r[2]})" for r in _as_runs(entries)[:3])
        raise AccountingRangeError(
            f"epsilon cannot be computed for the runs {runs}{' …' if len(entries) > 3 else ''} at delta={delta!r} "
            f"({accountant}): these numbers are outside what dp-accounting can evaluate ({type(exc).__name__}: "
            f"{str(exc)[:120]}). Check the entries: a training run's sigma is about 0.3 to 100 and its steps at "
            "most millions.") from exc


class AccountingRangeError(ValueError):
    """ε of a ledger's entries cannot be evaluated: its numbers (σ, q, steps) overflow the accountant's arithmetic
    or its memory (e.g. 10^15 steps, σ = 1e300)."""


def compute_epsilon(entries: Iterable, delta: float, accountant: str = "pld",
                    value_discretization_interval: Optional[float] = None) -> float:
    """Epsilon (nats) of the ordered composition of ``entries``: a valid upper bound on the true epsilon.

    Args:
        entries: runs with ``sample_rate`` q in (0, 1], ``noise_multiplier`` sigma >= 0 and ``steps``
            >= 0, each run meaning ``steps`` Poisson-subsampled Gaussian steps
            (``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)``).
        delta: target delta in (0, 1).
        accountant: ``"pld"`` (default: the PLD bound, or the RDP bound where that is smaller) or
            ``"rdp"``.
        value_discretization_interval: PLD grid width in nats; default None chooses it per ledger
            (:func:`lightning_dpzero.accounting.pld.value_discretization_interval`). Ignored for RDP.

    Returns epsilon (float, nats); ``0.0`` for no steps or when delta is at least the probability that an
    example is used at all; ``math.inf`` if any run with steps has sigma == 0. Raises ValueError on an
    unknown accountant, delta outside (0, 1) or an invalid run.
    """
    return epsilon_bound(entries, delta, accountant, value_discretization_interval).epsilon


def value_discretization_interval(entries: Iterable, delta: float) -> Optional[float]:
    """The PLD grid (nats) :func:`compute_epsilon` uses for ``entries`` at ``delta`` (None when no PLD is
    needed: no steps, sigma = 0, or epsilon 0 by the sampling shortcut)."""
    return epsilon_bound(entries, delta).value_discretization_interval


class EpsilonTracker:
    """Incremental epsilon for a growing ledger: cheap per step, never an under-statement.

    ``tracker.epsilon(ledger)`` may be called after every step. The last run of the ledger is the one that
    grows; with the earlier runs fixed, :func:`compute_epsilon` is non-decreasing in the last run's step
    count n (the PLD grid does not depend on n, so it is one discretised mechanism composed n times, and
    the RDP bound grows with n). The tracker therefore evaluates :func:`compute_epsilon` at
    n' = ``grid_point(n)`` >= n, where the grid is every integer up to ``exact_below`` and then
    ``ceil(exact_below * growth**k)``, and caches it. Guarantee:

        compute_epsilon(ledger) <= tracker.epsilon(ledger) = compute_epsilon(ledger with the last run at n'),

    with equality whenever n is a grid point. Since n' < growth * n + 1, the over-statement is that of at
    most ~2 % more steps (about 1 % in epsilon, which grows like sqrt(n)). ``exact=True`` returns
    :func:`compute_epsilon` of the ledger itself (use it at checkpoints, at the end and for anything
    published). Each grid point costs one PLD self-composition and one RDP sum (the one-step PLD, its grid
    and the earlier runs' composition are cached), and a ledger of 1e5 steps has ~450 grid points.

    Args:
        growth: grid ratio, > 1 (default 1.02).
        exact_below: every step count up to this is a grid point (default 50).
        value_discretization_interval: ignored (the grid is chosen per ledger); kept for compatibility.
        max_cache: number of cached epsilons kept (oldest dropped first).
    """

    def __init__(self, growth: float = 1.02, exact_below: int = 50,
                 value_discretization_interval: Optional[float] = None, max_cache: int = 4096):
        if not growth > 1.0:
            raise ValueError(f"growth must be > 1, got {growth!r}.")
        if int(exact_below) < 1:
            raise ValueError(f"exact_below must be >= 1, got {exact_below!r}.")
        self.growth, self.exact_below = float(growth), int(exact_below)
        self._cache: OrderedDict = OrderedDict()
        self._max_cache = int(max_cache)
        self.evaluations = 0  # number of epsilon evaluations done (for diagnostics)

    def grid_point(self, steps: int) -> int:
        """Smallest grid step count >= ``steps`` (``steps`` itself up to ``exact_below``)."""
        steps, e = int(steps), self.exact_below
        if steps <= e:
            return steps
        k = max(0, int(math.floor(math.log(steps / e) / math.log(self.growth))) - 1)
        while math.ceil(e * self.growth ** k) < steps:
            k += 1
        return int(math.ceil(e * self.growth ** k))

    def bound(self, ledger, exact: bool = False, delta: float | None = None,
              accountant: str | None = None) -> EpsilonBound:
        """:class:`EpsilonBound` of ``ledger`` at the next grid point (of the ledger itself when
        ``exact=True``); ``delta`` and ``accountant`` default to the ledger's own."""
        delta = _check_delta(ledger.delta if delta is None else delta)
        accountant = _check_accountant(ledger.accountant if accountant is None else accountant)
        runs, tails = _as_runs(ledger.entries), _exceed_probabilities(ledger.entries)
        if runs and not exact:
            q, s, n = runs[-1]
            runs = runs[:-1] + ((q, s, self.grid_point(n)),)
        p = _truncation_of_runs(runs, tails)
        key = (accountant, delta, runs, p)
        found = self._cache.get(key)
        if found is None:
            found = _truncated_bound(runs, delta, accountant, p)
            self.evaluations += 1
            self._cache[key] = found
            if len(self._cache) > self._max_cache:
                self._cache.popitem(last=False)
        return found

    def epsilon(self, ledger, exact: bool = False, delta: float | None = None,
                accountant: str | None = None) -> float:
        """Epsilon of ``ledger`` (an upper bound on :func:`compute_epsilon` of it; equal when
        ``exact=True``). ``delta`` and ``accountant`` default to the ledger's own. Returns ``math.inf`` if
        any run has sigma == 0, ``0.0`` if there are no steps."""
        return self.bound(ledger, exact, delta, accountant).epsilon
