"""Renyi-DP epsilon of a ledger, with dp-accounting's per-step RDP curves cached.

Mironov (CSF 2017), "Renyi differential privacy"; Mironov, Talwar & Zhang (2019), "Renyi differential
privacy of the sampled Gaussian mechanism"; conversion to (epsilon, delta) by dp-accounting's
``compute_epsilon`` (Balle et al. 2020 / Canonne, Kamath & Steinke 2020). An upper bound on the true epsilon.

``RdpAccountant`` recomputes the RDP curve of ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))`` on every
``compose``; a ledger of runs ``(q, sigma, steps)`` only needs one curve per ``(q, sigma)``, scaled by the
step count. :func:`rdp_epsilon` adds the scaled curves in ledger order, starting from zeros, exactly as
``RdpAccountant`` does, so it returns the same number as an accountant fed the same events.
"""

from __future__ import annotations

import functools
import logging

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as _rdp


#: A few of ``RdpAccountant``'s default orders, for quick estimates (bracketing sigma, choosing the PLD
#: grid): a valid upper bound, never below the default-order one.
COARSE_ORDERS = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 63.0, 128.0)


@functools.lru_cache(maxsize=1024)
def _curve(q: float, sigma: float, orders: tuple | None) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step at ``orders`` (``RdpAccountant``'s default orders when
    None), read-only."""
    acc = dp_accounting.rdp.RdpAccountant(orders=None if orders is None else list(orders))
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), 1)
    curve = acc.rdp
    curve.setflags(write=False)
    return curve


@functools.lru_cache(maxsize=8)
def _orders(orders: tuple | None) -> np.ndarray:
    return np.array(dp_accounting.rdp.RdpAccountant(orders=None if orders is None else list(orders)).orders)


class _QuietNegativeRdp(logging.Filter):
    """dp-accounting logs (via absl) a warning for each negative Renyi divergence from round-off in extreme
    settings and treats it as epsilon 0 at that order; the minimum over the other orders is still an upper
    bound, so the message is noise for a ledger evaluated at every step."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Negative Renyi divergence" not in record.getMessage()


_FILTER = _QuietNegativeRdp()


def rdp_epsilon(runs: tuple, delta: float, orders: tuple | None = None) -> float:
    """Epsilon by RDP of ``runs`` (tuple of ``(q, sigma, steps)`` with sigma > 0) at ``delta``, optimised
    over ``orders`` (default: ``RdpAccountant``'s; :data:`COARSE_ORDERS` is ~10x cheaper per new
    (q, sigma) and a little looser)."""
    grid = _orders(orders)
    total = np.zeros_like(grid, dtype=np.float64)
    for q, sigma, steps in runs:
        total += steps * _curve(q, sigma, orders)
    logger = logging.getLogger("absl")
    logger.addFilter(_FILTER)
    try:
        return float(_rdp.compute_epsilon(grid, total, delta)[0])
    finally:
        logger.removeFilter(_FILTER)
