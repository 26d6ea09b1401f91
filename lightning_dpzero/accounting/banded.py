"""Accounting of amplified banded matrix factorization (BandMF; :mod:`lightning_dpzero.banded_mf`).

With cyclic Poisson sampling over b parts and a b-banded ``C`` of unit column norms, ``T`` BandMF steps at
per-step rate ``q`` (expected batch / N) are ``⌈T / b⌉`` Poisson-subsampled Gaussian mechanisms at the part's
rate ``q_b = b · q`` with noise multiplier σ (Choquette-Choo et al., NeurIPS 2023, Theorem 4). Everything the
package accounts with ``(q, σ, steps)`` (the ledger's epsilon, :func:`.calibration.calibrate_noise_multiplier`,
the planner, the budget stop) is therefore used unchanged on the equivalent event :func:`banded_event`.
Splitting a run into several entries (resumes) rounds each up: a valid, slightly conservative bound.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from ..banded_mf import banded_accounting_steps, banded_coefficients, coefficients_digest

__all__ = ["BandedEvent", "banded_event", "banded_entries", "banded_ledger_fields"]


@dataclasses.dataclass(frozen=True)
class BandedEvent:
    """The Poisson-subsampled Gaussian composition equivalent to a BandMF run: ``steps`` rounds at
    ``sample_rate`` q_b with ``noise_multiplier`` σ (the attributes :func:`.accountants.compute_epsilon` reads)."""

    sample_rate: float
    noise_multiplier: float
    steps: int


def banded_event(sample_rate: float, noise_multiplier: float, steps: int, bands: int) -> BandedEvent:
    """The accounting event of ``steps`` BandMF steps with b = ``bands`` at per-step rate q = ``sample_rate``.

    Raises ValueError when ``b · q > 1`` (a part smaller than one expected batch) or b < 1.

    Example:
        >>> banded_event(0.01, 1.0, 1000, 4)
        BandedEvent(sample_rate=0.04, noise_multiplier=1.0, steps=250)
    """
    banded_coefficients(bands)
    q_b = int(bands) * float(sample_rate)
    if q_b > 1:
        raise ValueError(f"q_b = bands · q = {bands} · {sample_rate:g} > 1: each of the b parts holds fewer "
                         "examples than one expected batch. Use fewer bands or a smaller batch.")
    return BandedEvent(q_b, float(noise_multiplier), banded_accounting_steps(steps, bands))


def banded_entries(entries: Iterable, bands: int) -> tuple[BandedEvent, ...]:
    """Ledger entries (``sample_rate`` q, ``noise_multiplier``, ``steps``) of a BandMF run as their equivalent
    events, for :func:`.accountants.compute_epsilon`."""
    return tuple(banded_event(e.sample_rate, e.noise_multiplier, e.steps, bands) for e in entries if int(e.steps))


def banded_ledger_fields(bands: int) -> dict:
    """What the ledger records about the mechanism: ``noise_mechanism``, ``bands`` and the coefficients' digest."""
    return {"noise_mechanism": "banded-mf", "bands": int(bands), "coefficients_digest": coefficients_digest(bands)}
