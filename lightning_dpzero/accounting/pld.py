"""The PLD accountant's engine: the grid a ledger is evaluated on, and its epsilon from dp-accounting PLDs.

Every one-step privacy loss distribution is dp-accounting's
``privacy_loss_distribution.from_gaussian_mechanism`` (Poisson-subsampled Gaussian, add-or-remove-one
adjacency, pessimistic connect-the-dots discretisation: Koskela, Jalko & Honkela, AISTATS 2020; Doroshenko,
Ghazi, Kamath, Kumar & Manurangsi, PETS 2022), composed with dp-accounting's FFT self-composition and
pessimistic tail truncation, then inverted to epsilon at delta. Whatever the grid, the result is an upper
bound on the true epsilon; the grid only decides how tight it is and what it costs.

Why the grid (``value_discretization_interval`` h, in nats) is chosen per ledger: the discretisation moves
each step's privacy loss by a fraction of h, and over n steps these errors add up (a bias and an added
variance, both ~n h^2 in the smooth regime, ~n q h when a step's loss is narrower than h). A fixed h is
therefore far too coarse when q/sigma is small (h = 1e-3 overstated epsilon by 3x at q = 1e-3, sigma = 10,
1e5 steps) and needlessly fine when it is large. :func:`grid_interval` picks, for each (q, sigma, delta),
the coarsest power of two h for which three error estimates stay within ``TOLERANCE`` of epsilon for
every step count up to ``N_CAP``. The one-step PLD is built on h, 2h and 4h; the error of its mean and its
variance on h is extrapolated from the three (as ~h^p, p measured in [1, 2]), and

* bias: ``N_CAP * mean error <= TOLERANCE * max(eps_lo, EPSILON_FLOOR)``, eps_lo a lower-side estimate of
  epsilon after ``N_CAP`` steps (half the smaller of the RDP bound and the central-limit estimate from the
  one-step mean and variance);
* variance: ``variance error / variance <= TOLERANCE * max(1, EPSILON_FLOOR / eps_RDP)`` (added variance
  shifts epsilon by about eps * dvar / (2 var) when the composed loss is near Gaussian);
* grid rounding at few steps: ``h <= 0.1 * max(eps_1, EPSILON_FLOOR)`` (measured: the one-step error is
  about 0.03 h).

The choice depends on (q, sigma, delta) only, never on the step count, so for a growing run the epsilon is
that of one fixed discretised mechanism composed n times: non-decreasing in n, which the tracker and the
budget guard rely on. A one-step PLD never exceeds ``MAX_BASE_BINS`` points (at that cap the estimates may
not be met: still an upper bound, measured within 0.5 %). A ledger of several runs uses the finest of its
runs' grids, coarsened by powers of two while another run's one-step PLD on it would pass that cap or the
composed PLD ``MAX_COMPOSED_BINS``, so that the time per call stays bounded.

Epsilon is the larger of the remove and add directions' (add-or-remove-one adjacency). dp-accounting's
one-step add-direction PMF loses precision on fine grids (its connect-the-dots probabilities are second
differences of delta(eps) close to 1), which only ever inflates it; where the add direction decides, its
epsilon on 2h, an equally valid bound, is used when smaller.

The composition reproduces ``DensePLDPmf.self_compose`` / ``common.self_convolve`` bit for bit, except
that the Chernoff bounds' log moment generating functions of a one-step PMF are computed once instead of
at every call (they were three quarters of the cost of a call at small step counts). The inversion to
epsilon is ``pld_pmf._get_epsilon_for_delta`` vectorised (the library loops in Python over every point
above epsilon) and with the sum of exp(-loss) * prob kept in log space (the library's underflows past ~700
nats). ``tests/accounting/test_epsilon_accuracy.py`` checks both against the library; measured accuracy and cost are
in docs/privacy.md (*How epsilon is computed*).
"""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import dp_accounting
import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as _pld
from scipy import fft, special

from .rdp import COARSE_ORDERS, rdp_epsilon

#: Accuracy is targeted (each of the three error estimates) at this fraction of epsilon.
TOLERANCE = 0.003
#: Largest step count of one (q, sigma) run for which the grid is chosen to be accurate.
N_CAP = 10**6
#: Below this epsilon the target is absolute: TOLERANCE * EPSILON_FLOOR.
EPSILON_FLOOR = 0.01
#: Size caps (points) of a one-step PMF and of a composed PMF; they bound the time and memory per call.
MAX_BASE_BINS = 2**18
MAX_COMPOSED_BINS = 2**22

_TAIL = 1e-15      # dp-accounting's default tail_mass_truncation for compose / self_compose
_COARSEST = 0      # h = 2**0 nats: the coarsest grid chosen (two coarser ones serve the error estimates)


class _LRU:
    """A small thread-safe LRU map (PLDs can be megabytes; keep few)."""

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


class _Pmf:
    """A dense dp-accounting PMF and the log-MGFs its Chernoff truncation bounds need (computed once, on
    first use)."""

    def __init__(self, pmf):
        self.pmf = pmf.to_dense_pmf()
        self._log_mgfs = None

    @property
    def log_mgfs(self) -> tuple:
        if self._log_mgfs is None:  # as common.compute_self_convolve_bounds
            probs = self.pmf._probs
            self.orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / len(probs)
            self._log_mgfs = tuple(special.logsumexp(np.arange(len(probs)) * order, b=probs)
                                   for order in self.orders)
        return self._log_mgfs

    def bounds(self, n: int) -> tuple:
        """``common.compute_self_convolve_bounds(probs, n, _TAIL)`` from the cached log-MGFs."""
        upper, lower = (len(self.pmf._probs) - 1) * n, 0
        log_mgfs = self.log_mgfs
        for order, log_mgf in zip(self.orders, log_mgfs):
            bound = (n * log_mgf + math.log(2 / _TAIL)) / order
            if not math.isfinite(bound):
                continue
            if order > 0:
                upper = min(upper, math.ceil(bound))
            if order < 0:
                lower = max(lower, math.floor(bound))
        return lower, upper

    def self_compose(self, n: int) -> pld_pmf.DensePLDPmf:
        """``DensePLDPmf.self_compose(n)`` (tail mass truncation 1e-15), bit for bit."""
        pmf = self.pmf
        if n == 1:
            return pmf
        lower, upper = self.bounds(n)
        output_len = upper - lower + 1
        fast_len = fft.next_fast_len(max(output_len, len(pmf._probs)))
        out = np.real(fft.ifft(fft.fft(pmf._probs, fast_len) ** n))
        probs = np.array(np.roll(out, -lower)[:output_len])
        inf_mass = _TAIL - math.expm1(n * math.log1p(-pmf._infinity_mass))
        return pld_pmf.DensePLDPmf(pmf._discretization, pmf._lower_loss * n + lower, probs, inf_mass, True)

    def composed_size(self, n: int) -> int:
        lower, upper = self.bounds(n)
        return upper - lower + 1


@dataclass(frozen=True)
class _Base:
    """The one-step PLD of (q, sigma) on grid h: remove and add PMFs (one, shared, when q = 1)."""

    pmfs: tuple

    @property
    def size(self) -> int:
        return max(len(p.pmf._probs) for p in self.pmfs)


_BASES = _LRU(32)      # (q, sigma, h) -> _Base
_PREFIXES = _LRU(4)    # (runs, h) -> composed PMFs (tuple) of those runs


def _build_base(q: float, sigma: float, h: float) -> _Base:
    # Same call as dp_accounting.pld.PLDAccountant for PoissonSampledDpEvent(q, GaussianDpEvent(sigma)).
    pld = _pld.from_gaussian_mechanism(
        standard_deviation=sigma, sampling_prob=q, value_discretization_interval=h,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    remove = _Pmf(pld._pmf_remove)
    if pld._symmetric:
        return _Base((remove,))
    return _Base((remove, _Pmf(pld._pmf_add)))


def base(q: float, sigma: float, h: float) -> _Base:
    """The (cached) one-step PLD of the Poisson-subsampled Gaussian (q, sigma) on grid h."""
    key = (q, sigma, h)
    found = _BASES.get(key)
    return found if found is not None else _BASES.put(key, _build_base(q, sigma, h))


def epsilon_for_delta(pmf: pld_pmf.DensePLDPmf, delta: float) -> float:
    """``pmf.get_epsilon_for_delta(delta)``, vectorised: the same scan from the largest loss down, with the
    same stopping rule and formula, on cumulative sums instead of a Python loop. The sum of
    ``exp(-loss) * prob`` is kept as its logarithm: the library's linear sum underflows once losses pass
    ~700 nats, and then returns ``inf`` or a wrong (even too small) epsilon."""
    inf_mass = pmf._infinity_mass
    if inf_mass > delta:
        return math.inf
    probs = pmf._probs[::-1]
    losses = (pmf._lower_loss + len(probs) - 1 - np.arange(len(probs))) * pmf._discretization
    upper = inf_mass + np.cumsum(probs)        # masses after including each point, largest loss first
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # log of the running sum of exp(-loss) * prob; FFT round-off leaves some probs slightly negative,
        # so the positive and negative terms are summed apart and subtracted
        pos = np.logaddexp.accumulate(np.where(probs > 0, np.log(np.abs(probs)) - losses, -np.inf))
        neg = np.logaddexp.accumulate(np.where(probs < 0, np.log(np.abs(probs)) - losses, -np.inf))
        log_lower = np.where(neg < pos, pos + np.log1p(-np.exp(neg - pos)), np.nan)  # nan: sum <= 0
        log_lower[(pos == -np.inf) & (neg == -np.inf)] = -np.inf                    # nothing yet: sum 0
        upper_before = np.concatenate(([inf_mass], upper[:-1]))
        log_lower_before = np.concatenate(([-np.inf], log_lower[:-1]))
        candidate = np.log(upper_before - delta) - log_lower_before
    stop = (upper_before > delta) & (log_lower_before > -np.inf) & (candidate >= losses)
    no_lower = (upper >= delta) & (log_lower == -np.inf)  # sum still 0: the library returns max(0, loss)
    i_stop = int(np.argmax(stop)) if stop.any() else len(probs)
    i_zero = int(np.argmax(no_lower)) if no_lower.any() else len(probs)
    if i_zero < i_stop:
        return max(0.0, float(losses[i_zero]))
    if i_stop < len(probs):
        mass_upper, log_mass_lower = upper_before[i_stop], log_lower_before[i_stop]
    else:
        mass_upper, log_mass_lower = upper[-1], log_lower[-1]
    if math.isnan(log_mass_lower):
        return math.inf  # round-off made the sum non-positive: no finite bound from this PMF
    if mass_upper <= delta or math.log(mass_upper - delta) <= log_mass_lower:
        return 0.0
    return float(math.log(mass_upper - delta) - log_mass_lower)


def _epsilon_of_pmfs(pmfs: tuple, delta: float) -> float:
    return max(epsilon_for_delta(p, delta) for p in pmfs)


# ------------------------------------------------------------------------------------------------ the grid
def _moments(pmf: pld_pmf.DensePLDPmf) -> tuple:
    losses = (np.arange(len(pmf._probs)) + pmf._lower_loss) * pmf._discretization
    p = pmf._probs
    mass = p.sum()
    mean = float(np.dot(losses, p) / mass)
    return mean, float(np.dot((losses - mean) ** 2, p) / mass)


def _gaussian_epsilon(mean: float, var: float, delta: float) -> float:
    """Epsilon at delta of a privacy loss distributed N(mean, var): the central-limit estimate of a long
    composition from its per-step mean and variance (delta(eps) = E[(1 - e^(eps - L))_+])."""
    sd = math.sqrt(var)
    if sd == 0.0:
        return max(mean, 0.0)

    def delta_of(eps: float) -> float:
        z = (mean - eps) / sd
        return float(special.ndtr(z) - math.exp(min(eps - mean + var / 2 + special.log_ndtr(z - sd), 700.0)))

    lo, hi = 0.0, max(mean, 0.0) + 40.0 * sd
    if delta_of(lo) <= delta:
        return 0.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


@functools.lru_cache(maxsize=512)
def grid_interval(q: float, sigma: float, delta: float) -> float:
    """The grid h (nats, a power of two) for runs of the Poisson-subsampled Gaussian (q, sigma) at delta:
    the coarsest that meets the module's three error estimates for every step count up to ``N_CAP``, or
    the finest with at most ``MAX_BASE_BINS`` points. Requires sigma > 0."""
    eps_n = rdp_epsilon(((q, sigma, N_CAP),), delta, COARSE_ORDERS)
    var_budget = TOLERANCE * max(1.0, EPSILON_FLOOR / eps_n) if eps_n > 0 else math.inf
    built: dict = {}

    def at(k: int) -> _Base:
        if k not in built:
            built[k] = _build_base(q, sigma, 2.0**-k)
        return built[k]

    def error(k: int, i: int) -> float:
        """Discretisation error at grid 2^-k of one-step moment i (0: mean, 1: variance), extrapolated
        from the grids 2^-(k-2), 2^-(k-1), 2^-k assuming it scales like h^p (p measured, clamped to
        [1, 2]), with a safety factor of 1.5 on the mean and 0.75 on the variance."""
        m = [_moments(at(j).pmfs[0].pmf)[i] for j in (k - 2, k - 1, k)]
        d1, d2 = m[0] - m[1], m[1] - m[2]
        p = min(max(math.log2(d1 / d2), 1.0), 2.0) if d1 > 0 and d2 > 0 else 1.0
        return (1.5 if i == 0 else 0.75) * abs(d2) / (2.0**p - 1.0)

    def meets(k: int) -> bool:
        """Do the error estimates allow h = 2^-k?"""
        fine = at(k)
        mean, var = _moments(fine.pmfs[0].pmf)
        eps_1 = _epsilon_of_pmfs(tuple(p.pmf for p in fine.pmfs), delta)
        # a lower-side estimate of epsilon after N_CAP steps: RDP overstates it (up to ~10x at small
        # epsilon), the central-limit estimate understates it when rare large losses dominate
        eps_lo = min(eps_n, _gaussian_epsilon(N_CAP * mean, N_CAP * var, delta)) / 2
        bias_budget = TOLERANCE * max(eps_lo, EPSILON_FLOOR) / N_CAP
        return (error(k, 0) <= bias_budget and error(k, 1) <= var_budget * var
                and 2.0**-k <= 0.1 * max(eps_1, EPSILON_FLOOR))

    # start near the grid that resolves one step's loss spread, about three levels coarser than usually
    # needed (q * sqrt(e^{1/sigma^2} - 1) is that spread for small q, 1/sigma for q = 1), then walk
    spread = min(q * math.sqrt(math.expm1(min(1.0 / sigma**2, 700.0))), 1.0 / sigma)
    k = max(_COARSEST, math.floor(-math.log2(spread)))
    # once a PMF has a few dozen points its size doubles with each level: never build one above the cap
    ref = _COARSEST
    while ref < k and at(ref).size < 64:
        ref += 1
    finest = ref + max(0, int(math.floor(math.log2(MAX_BASE_BINS / at(ref).size))))
    k = min(k, finest)
    if meets(k):
        while k > _COARSEST and meets(k - 1):
            k -= 1
    else:  # refine while within the cap; at the cap keep the finest that fits
        while k < finest and not meets(k + 1):
            k += 1
        k = min(k + 1, finest)
    _BASES.put((q, sigma, 2.0**-k), at(k))
    return 2.0**-k


def value_discretization_interval(runs: tuple, delta: float) -> float:
    """The grid for a ledger of ``runs`` ((q, sigma, steps), sigma > 0): the finest of the runs' grids,
    doubled while another run's one-step PMF on it would exceed ``MAX_BASE_BINS`` points or the composed
    PMF ``MAX_COMPOSED_BINS``."""
    own = {(q, s): grid_interval(q, s, delta) for q, s, _ in runs}
    h = min(own.values())

    def too_big(h: float) -> bool:
        # a one-step PMF has about (its size on its own grid) x (own grid / h) points on grid h
        if any(base(q, s, g).size * g / h > MAX_BASE_BINS for (q, s), g in own.items()):
            return True
        return sum(max(p.composed_size(n) for p in base(q, s, h).pmfs) for q, s, n in runs) > MAX_COMPOSED_BINS

    while too_big(h):
        h *= 2
    return h


# ------------------------------------------------------------------------------------------------ epsilon
def _compose(a: tuple, b: tuple) -> tuple:
    """Composition of two PLDs given as PMF tuples (remove,) or (remove, add), as PrivacyLossDistribution
    .compose does (tail mass truncation 1e-15)."""
    if len(a) == 1 and len(b) == 1:
        return (a[0].compose(b[0], _TAIL),)
    return tuple(x.compose(y, _TAIL) for x, y in zip((a[0], a[-1]), (b[0], b[-1])))


def _run_pmfs(run: tuple, h: float) -> tuple:
    q, s, n = run
    return tuple(p.self_compose(n) for p in base(q, s, h).pmfs)


def _composed(runs: tuple, h: float) -> tuple:
    """PMFs of ``runs`` composed in order (cached; extends a cached shorter prefix when there is one)."""
    found = _PREFIXES.get((runs, h))
    if found is not None:
        return found
    start = _PREFIXES.get((runs[:-1], h)) if len(runs) > 1 else None
    if start is not None:
        pmfs = _compose(start, _run_pmfs(runs[-1], h))
    else:
        pmfs = _run_pmfs(runs[0], h)
        for run in runs[1:]:
            pmfs = _compose(pmfs, _run_pmfs(run, h))
    return _PREFIXES.put((runs, h), pmfs)


def pld_epsilon(runs: tuple, delta: float, h: float | None = None) -> float:
    """Epsilon by PLD of the ordered composition of ``runs`` ((q, sigma, steps), sigma > 0, steps >= 1) at
    ``delta``, on grid ``h`` (default :func:`value_discretization_interval`). The composition of all runs
    but the last is cached, so a growing last run costs one self-composition per call."""
    if h is None:
        h = value_discretization_interval(runs, delta)
    pmfs = _all_runs(runs, h)
    eps = epsilon_for_delta(pmfs[0], delta)
    if len(pmfs) == 1:
        return eps
    eps_add = epsilon_for_delta(pmfs[1], delta)
    if eps_add > eps:
        # The add direction decides. Its one-step PMF loses precision on fine grids (dp-accounting's
        # connect-the-dots takes second differences of delta(eps) close to 1 there), which only ever
        # inflates it; the same direction on the grid 2h is an equally valid bound, so take the smaller.
        eps_add = min(eps_add, epsilon_for_delta(_all_runs(runs, 2 * h)[1], delta))
    return max(eps, eps_add)


def _all_runs(runs: tuple, h: float) -> tuple:
    last = _run_pmfs(runs[-1], h)
    return _compose(_composed(runs[:-1], h), last) if len(runs) > 1 else last
