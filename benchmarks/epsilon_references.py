"""Reference epsilons for tests/accounting/test_epsilon_accuracy.py, computed independently of lightning_dpzero.

For each setting (q, sigma, steps, delta) of one run of the Poisson-subsampled Gaussian mechanism under
add-or-remove-one adjacency this records

* ``pld_levels``: dp-accounting's pessimistic PLD epsilon (``from_gaussian_mechanism``, connect-the-dots;
  one-step PMFs made dense, ``self_compose(steps)``, ``get_epsilon_for_delta`` of each direction, the larger)
  on grids h = 2^-k for k = 2, 3, ... until two successive grids agree to 2e-5, a finer grid gives a larger
  value (dp-accounting loses precision on very fine grids, only ever upwards), or one evaluation takes
  more than a minute. Every value is a valid upper bound on the true epsilon, so ``pld`` = their minimum is
  one too: the tightest the library gives;
* ``rdp``: dp-accounting's ``RdpAccountant`` (default orders), another valid upper bound;
* ``prv``: where affordable (``--prv``, opacus installed), Opacus 1.6's PRV accountant bracket
  ``[lower, estimate, upper]`` (Gopi, Lee & Wutschitz, NeurIPS 2021: FFT over a mesh with explicit error
  bounds) at eps_error = 0.5 % of ``pld``, for the remove direction; ``lower`` bounds the true epsilon from
  below, so a correct upper bound can never be under it.

The test asserts, for the package's ``compute_epsilon``: at least ``prv.lower`` (never optimistic), and at
most 1.01 x min(pld, rdp) (or min + 1e-4 where that is below 0.01). Run it (about an hour on two cores)::

    python benchmarks/epsilon_references.py tests/data/epsilon_references.json [--prv]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from importlib import metadata

import dp_accounting
from dp_accounting.pld import privacy_loss_distribution as _pld

#: (q, sigma) pairs covering the corners of q in [1e-5, 1], sigma in [0.3, 100], and the steps for each.
SETTINGS = [
    (q, s, n, 1e-5)
    for q, s in [(1e-5, 0.5), (1e-5, 2.0), (1e-5, 100.0), (1e-4, 1.0), (1e-4, 0.3), (1e-3, 0.3), (1e-3, 3.0),
                 (1e-3, 10.0), (1e-2, 1.0), (1e-2, 30.0), (0.1, 0.5), (0.1, 5.0), (0.3, 2.0), (1.0, 1.0),
                 (1.0, 100.0)]
    for n in (1, 100, 10_000, 1_000_000)
] + [(0.01, 1.0, 1000, 1e-3), (0.01, 1.0, 1000, 1e-8), (1e-3, 10.0, 100_000, 1e-8), (0.05, 0.8, 3000, 1e-6)]


def pld_levels(q: float, sigma: float, steps: int, delta: float, time_cap: float = 60.0) -> dict:
    levels, best = {}, math.inf
    for k in range(2, 40):
        h = 2.0**-k
        t0 = time.perf_counter()
        pld = _pld.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=h)
        eps = 0.0
        for pmf in {id(pld._pmf_remove): pld._pmf_remove, id(pld._pmf_add): pld._pmf_add}.values():
            dense = pmf.to_dense_pmf()
            eps = max(eps, (dense.self_compose(steps) if steps > 1 else dense).get_epsilon_for_delta(delta))
        levels[k] = eps
        seconds = time.perf_counter() - t0
        if eps > best * (1 + 1e-3) + 1e-12:
            break
        prev, best = best, min(best, eps)
        if len(levels) >= 3 and abs(eps - prev) <= 2e-5 * max(eps, 1e-300) and eps <= best:
            vals = list(levels.values())
            if abs(vals[-2] - vals[-3]) <= 1e-4 * max(eps, 1e-300):
                break
        if seconds > time_cap or (steps == 1 and k >= 24):
            break
    return levels


def rdp_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return float(acc.get_epsilon(delta))


def prv_bracket(q: float, sigma: float, steps: int, delta: float, eps_error: float, max_size: float = 3e7):
    import numpy as np
    from opacus.accountants.analysis.prv import (Domain, PoissonSubsampledGaussianPRV,
                                                 TruncatedPrivacyRandomVariable, compose_heterogeneous,
                                                 compute_safe_domain_size, discretize)

    delta_error = delta / 1000
    prv = PoissonSubsampledGaussianPRV(q, sigma)
    size = compute_safe_domain_size(prvs=[prv], max_self_compositions=[steps], eps_error=eps_error,
                                    delta_error=delta_error)
    mesh = eps_error / np.sqrt(steps * np.log(12 / delta_error) / 2)
    if 2 * size / mesh > max_size:
        return None
    domain = Domain.create_aligned(-size, size, mesh)
    dprv = discretize(TruncatedPrivacyRandomVariable(prv, domain.t_min, domain.t_max), domain)
    lower, estimate, upper = compose_heterogeneous(dprvs=[dprv], num_self_compositions=[steps]).compute_epsilon(
        delta, delta_error, eps_error)
    return [float(lower), float(estimate), float(upper)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("output")
    p.add_argument("--prv", action="store_true", help="also compute Opacus PRV brackets where affordable")
    a = p.parse_args(argv)
    rows = []
    for q, sigma, steps, delta in SETTINGS:
        t0 = time.perf_counter()
        levels = pld_levels(q, sigma, steps, delta)
        row = {"sample_rate": q, "noise_multiplier": sigma, "steps": steps, "delta": delta,
               "pld": min(levels.values()), "pld_levels": {str(k): v for k, v in levels.items()},
               "rdp": rdp_epsilon(q, sigma, steps, delta)}
        if a.prv and 0 < row["pld"] < 500:
            try:
                row["prv"] = prv_bracket(q, sigma, steps, delta, 0.005 * row["pld"])
            except Exception as exc:  # noqa: BLE001 - recorded, not fatal
                row["prv_error"] = repr(exc)[:200]
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {"how": __doc__, "machine": platform.processor() or platform.machine(),
           "versions": {d: metadata.version(d) for d in ("dp-accounting", "numpy", "scipy")}, "settings": rows}
    if a.prv:
        doc["versions"]["opacus"] = metadata.version("opacus")
    with open(a.output, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
