"""Accounting of amplified banded matrix factorization (BandMF; :mod:`lightning_dpzero.banded_mf`).

With cyclic Poisson sampling over b parts and a b-banded ``C`` of unit column norms, ``T`` BandMF steps at
per-step rate ``q`` (expected batch / N) are ``⌈T / b⌉`` Poisson-subsampled Gaussian mechanisms at the part's
rate ``q_b = b · q`` with noise multiplier σ (Choquette-Choo et al., NeurIPS 2023, Theorem 4).

The ledger records such steps with the sampler ``"cyclic-poisson:b"`` (:func:`cyclic_sampler_kind`) and the
per-step q; every ε the package computes goes through :func:`equivalent_run`, which turns a run of them into
its equivalent ``(q_b, σ, ⌈T / b⌉)`` (``accountants._as_runs``, the budget guard, calibration, the plan), so
the ledger's ε, the planner, calibration and the budget stop need nothing else. A run split into several
entries (resumes) rounds each up: ``Σ ⌈T_i / b⌉ >= ⌈Σ T_i / b⌉``, a valid, slightly conservative bound.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Optional

from .blt import blt_of, blt_sensitivity

__all__ = ["CYCLIC_PREFIX", "cyclic_sampler_kind", "bands_of", "parts_of", "sampler_text", "equivalent_run",
           "noise_scale", "BandedEvent", "banded_event", "banded_entries"]

CYCLIC_PREFIX = "cyclic-poisson"
_CYCLIC = re.compile(r"^cyclic-poisson:([1-9][0-9]*)$")


def cyclic_sampler_kind(bands: int) -> str:
    """The ledger's sampler of cyclic Poisson sampling over ``bands`` parts: ``"cyclic-poisson:<b>"``.

    Example:
        >>> cyclic_sampler_kind(4), bands_of("cyclic-poisson:4"), bands_of("poisson")
        ('cyclic-poisson:4', 4, None)
    """
    return f"{CYCLIC_PREFIX}:{int(bands)}"


def bands_of(sampler: str) -> Optional[int]:
    """b of a ``"cyclic-poisson:<b>"`` sampler; None for any other sampler."""
    found = _CYCLIC.match(str(sampler))
    return int(found.group(1)) if found else None


def parts_of(sampler: str) -> Optional[int]:
    """The number of cyclic parts b of a correlated-noise sampler (banded MF's or BLT's); None for any other."""
    blt = blt_of(sampler)
    return blt[0] if blt is not None else bands_of(sampler)


def sampler_text(sampler: str) -> str:
    """A ledger sampler in words, for the run's summary lines.

    Example:
        >>> sampler_text("poisson"), sampler_text("cyclic-poisson:4")
        ('Poisson', 'cyclic Poisson over 4 parts, banded-MF noise')
    """
    b = bands_of(sampler)
    if b is not None:
        return f"cyclic Poisson over {b} parts, banded-MF noise"
    blt = blt_of(sampler)
    if blt is not None:
        return f"cyclic Poisson over {blt[0]} parts, BLT noise with {blt[1].buffers} buffers, not amplified"
    return "Poisson" if sampler == "poisson" else "shuffled batches"


def equivalent_run(sample_rate: float, noise_multiplier: float, steps: int, sampler: str = "poisson"
                   ) -> tuple[float, float, int]:
    """``(q, σ, steps)`` as the Poisson-subsampled Gaussian composition the accountant composes: unchanged for
    ``"poisson"`` and ``"shuffle"``, ``(b·q, σ, ⌈steps / b⌉)`` for ``"cyclic-poisson:<b>"``, and for BLT noise
    (``"cyclic-blt:..."``) one Gaussian mechanism, ``(1, σ / Δ_steps, 1)`` with Δ its exact sensitivity over the
    steps (:func:`.blt.blt_sensitivity`; a run of several entries is merged first, ``accountants._as_runs``).

    Raises ValueError when ``b · q > 1`` (a part smaller than one expected batch).

    Example:
        >>> equivalent_run(0.01, 1.0, 1000, "cyclic-poisson:4"), equivalent_run(0.01, 1.0, 7, "poisson")
        ((0.04, 1.0, 250), (0.01, 1.0, 7))
    """
    b = bands_of(sampler)
    if b is None:
        if blt_of(sampler) is not None and int(steps) > 0:
            return 1.0, float(noise_multiplier) / noise_scale(sampler, steps), 1
        return float(sample_rate), float(noise_multiplier), int(steps)
    q_b = b * float(sample_rate)
    if q_b > 1 + 1e-12:
        raise ValueError(f"q_b = bands · q = {b} · {sample_rate:g} > 1: each of the b parts holds fewer examples "
                         "than one expected batch. Use fewer bands or a smaller batch.")
    return min(q_b, 1.0), float(noise_multiplier), -(-int(steps) // b)


def noise_scale(sampler: str, steps: Optional[int]) -> float:
    """The factor from the accounted noise multiplier to σ: Δ over ``steps`` steps for BLT noise (σ = σ_acc · Δ),
    1.0 for every other sampler or without steps.

    Example:
        >>> noise_scale("poisson", 100), noise_scale("cyclic-blt:4:0.5;0.0", 16)
        (1.0, 2.0)
    """
    blt = blt_of(sampler)
    if blt is None or not steps:
        return 1.0
    return blt_sensitivity(blt[1], int(steps), blt[0])


@dataclasses.dataclass(frozen=True)
class BandedEvent:
    """The Poisson-subsampled Gaussian composition equivalent to a BandMF run: ``steps`` rounds at
    ``sample_rate`` q_b with ``noise_multiplier`` σ (the attributes :func:`.accountants.compute_epsilon` reads)."""

    sample_rate: float
    noise_multiplier: float
    steps: int


def banded_event(sample_rate: float, noise_multiplier: float, steps: int, bands: int) -> BandedEvent:
    """The accounting event of ``steps`` BandMF steps with b = ``bands`` at per-step rate q = ``sample_rate``.

    Raises ValueError when ``b · q > 1`` or b < 1.

    Example:
        >>> banded_event(0.01, 1.0, 1000, 4)
        BandedEvent(sample_rate=0.04, noise_multiplier=1.0, steps=250)
    """
    if isinstance(bands, bool) or int(bands) != bands or bands < 1:
        raise ValueError(f"bands={bands!r} must be an integer >= 1.")
    return BandedEvent(*equivalent_run(sample_rate, noise_multiplier, steps, cyclic_sampler_kind(bands)))


def banded_entries(entries: Iterable, bands: int) -> tuple[BandedEvent, ...]:
    """Entries (``sample_rate`` q, ``noise_multiplier``, ``steps``) of a BandMF run as their equivalent events."""
    return tuple(banded_event(e.sample_rate, e.noise_multiplier, e.steps, bands) for e in entries if int(e.steps))
