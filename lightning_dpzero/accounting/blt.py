"""Buffered linear Toeplitz (BLT) matrix factorization: coefficients, exact sensitivity under cyclic participation,
and parameters optimised for a run (Dvijotham, McMahan, Pillutla, Steinke, Thakurta, "Efficient and Near-Optimal
Noise Generation for Streaming Differential Privacy", FOCS 2024).

A BLT with d buffers, decays ``θ ∈ (0, 1)^d`` and weights ``ω >= 0`` is the infinite lower-triangular Toeplitz
``C`` with ``c_0 = 1`` and ``c_k = Σ_i ω_i θ_i^(k-1)`` for k >= 1. The noise released at step t is ``ν_t`` of
``ν = C⁻¹ z``, which needs only d state vectors of the model's size (:class:`lightning_dpzero.blt.BLTNoiseSource`).

**Sensitivity (exact, no amplification claimed).** The mechanism is equivalent to releasing ``C x + z``. With cyclic
sampling over b parts (:mod:`..sampling.cyclic`) an example of part p can only take part at steps
``p, p + b, p + 2b, ...``. Every ``c_k >= 0``, so every two columns of ``C`` have a non-negative inner product, and
the worst case over which of those steps an example is sampled at (and over its clipped gradients ``‖g‖ <= C_clip``)
is taking part at all of them with the same gradient: ``Δ_p² = ‖Σ_j C[:T, p + jb]‖² = Σ_{m < T-p} S_m²`` with
``S_m = Σ_{j >= 0, jb <= m} c_{m - jb}``, largest at p = 0. So ``T`` steps are **one** Gaussian mechanism of
sensitivity ``Δ = sqrt(Σ_{m<T} S_m²) · C_clip`` and noise ``σ C_clip``: noise multiplier ``σ / Δ``, with no
amplification by sampling (the sampling inside a part is not used by the analysis; it only makes the guarantee
conservative). ``Δ`` grows with T, so ε is recomputed from the whole run's step count.

**Parameters.** :func:`optimize_blt` minimises the expected squared error of the prefix sums (the model's
trajectory under SGD) for the run's steps at equal privacy, ``Δ² · ‖A C⁻¹‖_F² / T`` (A: the lower-triangular ones),
over θ and ω by L-BFGS in float64 (torch), from geometric initial decays.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
from typing import Optional, Sequence

import numpy as np

__all__ = ["BLT_PREFIX", "BLTParams", "blt_sensitivity", "prefix_sum_error", "optimize_blt", "blt_for_run",
           "blt_sampler_kind", "blt_of", "DEFAULT_BUFFERS", "HORIZON_CAP"]

BLT_PREFIX = "cyclic-blt"
DEFAULT_BUFFERS = 4  #: buffers of the optimised BLT: the paper finds 3-5 within a few percent of the optimum
HORIZON_CAP = 20_000  #: longer runs get the BLT optimised for this many steps (seconds at the start of a fit, not
                      #: minutes); the accounting is exact for any length whatever horizon θ, ω were fitted for
_KIND = re.compile(r"^cyclic-blt:([1-9][0-9]*):([^;]+);([^;]+)$")


@dataclasses.dataclass(frozen=True)
class BLTParams:
    """A BLT's decays ``theta`` (each in (0, 1)) and weights ``omega`` (each >= 0), d = ``len(theta)`` buffers.

    Raises:
        ValueError: lengths differ, no buffer, a decay outside (0, 1), or a negative or non-finite weight (the
            exact sensitivity needs ``c_k >= 0``).

    Example:
        >>> p = BLTParams((0.5,), (0.25,)); p.coefficients(4).tolist()
        [1.0, 0.25, 0.125, 0.0625]
        >>> bool(np.allclose(np.linalg.inv(p.matrix(5))[:, 0], p.inverse_coefficients(5)))
        True
    """

    theta: tuple[float, ...]
    omega: tuple[float, ...]

    def __post_init__(self) -> None:
        theta, omega = tuple(float(t) for t in self.theta), tuple(float(w) for w in self.omega)
        object.__setattr__(self, "theta", theta)
        object.__setattr__(self, "omega", omega)
        if not theta or len(theta) != len(omega):
            raise ValueError(f"BLT needs as many decays as weights, at least one: got {len(theta)} and {len(omega)}.")
        if not all(0.0 < t < 1.0 for t in theta):
            raise ValueError(f"BLT decays theta={theta} must each be in (0, 1).")
        if not all(w >= 0.0 and math.isfinite(w) for w in omega):
            raise ValueError(f"BLT weights omega={omega} must each be finite and >= 0 (the exact sensitivity "
                             "needs non-negative coefficients).")

    @property
    def buffers(self) -> int:
        return len(self.theta)

    def coefficients(self, steps: int) -> np.ndarray:
        """``c_0..c_{steps-1}`` (float64): the first column of ``C``."""
        k = np.arange(max(int(steps) - 1, 0), dtype=np.float64)
        tail = (np.asarray(self.omega)[None, :] * np.asarray(self.theta)[None, :] ** k[:, None]).sum(1)
        return np.concatenate([[1.0], tail])[: int(steps)]

    def inverse_coefficients(self, steps: int) -> np.ndarray:
        """The first column of ``C⁻¹`` (float64, ``steps``): the noise a unit draw at step 0 leaves at step k, by
        the recursion :class:`~lightning_dpzero.blt.BLTNoiseSource` runs (``ν_t = z_t - ω·s_t``, ``s ← θ s + ν_t``)."""
        theta, omega = np.asarray(self.theta), np.asarray(self.omega)
        s, out = np.zeros(self.buffers), np.zeros(int(steps))
        for t in range(int(steps)):
            out[t] = (1.0 if t == 0 else 0.0) - omega @ s
            s = theta * s + out[t]
        return out

    def matrix(self, steps: int) -> np.ndarray:
        """The ``steps × steps`` lower-triangular Toeplitz ``C`` (float64), for tests and analysis."""
        c = self.coefficients(steps)
        idx = np.subtract.outer(np.arange(steps), np.arange(steps))
        return np.where(idx >= 0, c[np.clip(idx, 0, None)], 0.0)

    def digest(self) -> str:
        """SHA-256 (hex) of θ and ω as float64 bytes: what the ledger records."""
        return hashlib.sha256(np.asarray(self.theta + self.omega, dtype=np.float64).tobytes()).hexdigest()


def blt_sensitivity(params: BLTParams, steps: int, min_separation: int) -> float:
    """``Δ / C_clip``: the L2 sensitivity of ``C x`` over ``steps`` steps when an example can take part only at steps
    ``p, p + b, ...`` of its part p (b = ``min_separation``), every participation clipped to norm 1 (module doc).

    Equals ``sqrt(⌈steps / b⌉)`` for the identity (ω = 0: DP-SGD's noise, not amplified).

    Example:
        >>> round(blt_sensitivity(BLTParams((0.5,), (0.0,)), 10, 3) ** 2, 12)
        4.0
    """
    n, b = int(steps), int(min_separation)
    if n < 1 or b < 1:
        raise ValueError(f"steps={steps} and min_separation={min_separation} must be >= 1.")
    c = params.coefficients(n)
    rounds = -(-n // b)
    s = np.concatenate([c, np.zeros(rounds * b - n)]).reshape(rounds, b).cumsum(0).reshape(-1)[:n]
    return float(np.sqrt((s ** 2).sum()))


def prefix_sum_error(params: BLTParams, steps: int) -> float:
    """``‖A C⁻¹‖_F² / steps``: the mean variance per step, for unit noise, of the released prefix sums (the sum of
    the noise the model has followed up to each step). DP-SGD's (C = I) is ``(steps + 1) / 2``."""
    beta = np.cumsum(params.inverse_coefficients(steps))
    n = int(steps)
    return float(((n - np.arange(n)) * beta ** 2).sum() / n)


def _torch_loss(u, v, n: int, b: int):
    """log(Δ²) + log(‖A C⁻¹‖_F² / n) for θ = sigmoid(u), ω = exp(v), differentiable (float64 torch)."""
    import torch

    theta, omega = torch.sigmoid(u), torch.exp(v)
    d = theta.numel()
    k = torch.arange(n - 1, dtype=torch.float64)
    c = torch.cat([torch.ones(1, dtype=torch.float64), (omega * theta ** k[:, None]).sum(1)])
    rounds = -(-n // b)
    s = torch.cat([c, torch.zeros(rounds * b - n, dtype=torch.float64)]).view(rounds, b).cumsum(0).reshape(-1)[:n]
    sens2 = (s ** 2).sum()
    # C⁻¹'s first column: ĉ_0 = 1, ĉ_k = -ω·M^(k-1) 1 with M = diag(θ) - 1 ωᵀ (the recursion's state matrix); the
    # rows M^j 1 for j < n - 1 by doubling, so the graph has log n matrix products, not n steps
    m = torch.diag(theta) - torch.ones(d, 1, dtype=torch.float64) * omega[None, :]
    rows, power = torch.ones(1, d, dtype=torch.float64), m
    while rows.shape[0] < n - 1:
        rows = torch.cat([rows, rows @ power.T])
        power = power @ power
    chat = torch.cat([torch.ones(1, dtype=torch.float64), -(rows[: n - 1] @ omega)])
    beta = chat.cumsum(0)
    err = ((n - torch.arange(n, dtype=torch.float64)) * beta ** 2).sum() / n
    return torch.log(sens2) + torch.log(err)


@functools.lru_cache(maxsize=32)
def optimize_blt(steps: int, min_separation: int, buffers: int = DEFAULT_BUFFERS) -> BLTParams:
    """BLT parameters minimising ``Δ² · ‖A C⁻¹‖_F² / steps`` (the prefix sums' mean squared error at equal privacy,
    module doc) for ``steps`` steps with participations ``min_separation`` = b apart. Deterministic (float64, CPU);
    cached. A few seconds of CPU up to 10,000 steps, about 30 s at 100,000.

    Raises:
        ValueError: steps, min_separation or buffers < 1.

    Example:
        >>> p = optimize_blt(64, 4, buffers=2)
        >>> ours = blt_sensitivity(p, 64, 4) ** 2 * prefix_sum_error(p, 64)
        >>> sgd = 16 * 65 / 2  # C = I: Δ² = ⌈64/4⌉ participations, error (T + 1) / 2
        >>> bool(ours < 0.8 * sgd)
        True
    """
    import torch

    n, b, d = int(steps), int(min_separation), int(buffers)
    if n < 1 or b < 1 or d < 1:
        raise ValueError(f"steps={steps}, min_separation={min_separation} and buffers={buffers} must be >= 1.")
    if n < 3:  # nothing to correlate: C = I up to a vanishing weight
        return BLTParams(tuple(0.5 for _ in range(d)), tuple(0.0 for _ in range(d)))
    u, v = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in _initial(n, d))
    best = (float(_torch_loss(u, v, n, b).detach()), u.detach().clone(), v.detach().clone())
    opt = torch.optim.LBFGS([u, v], lr=1.0, max_iter=100, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-9, tolerance_change=1e-12)

    def closure():
        opt.zero_grad()
        loss = _torch_loss(u, v, n, b)
        if torch.isfinite(loss):
            loss.backward()
        return loss

    for _ in range(3):
        try:
            opt.step(closure)
        except RuntimeError:  # a line search that left the region where C⁻¹ is stable
            break
        loss = float(_torch_loss(u, v, n, b).detach())
        if not (math.isfinite(loss) and loss < best[0] - 1e-9):
            break
        best = (loss, u.detach().clone(), v.detach().clone())
    theta, omega = torch.sigmoid(best[1]).tolist(), torch.exp(best[2]).tolist()
    # buffers whose weight vanished (the optimum often merges or drops some) cost memory and add nothing
    keep = [i for i, w in enumerate(omega) if w > max(1e-6 * max(omega), 1e-9)] or [int(np.argmax(omega))]
    return BLTParams(tuple(min(max(theta[i], 1e-9), 1 - 1e-9) for i in keep), tuple(omega[i] for i in keep))


def _initial(n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Starting (u, v) = (logit θ, log ω): decays on geometric time scales 2..n, weights the non-negative least
    squares fit of the coefficients of (1 - x)^(-1/2) (the square root of the prefix sums, optimal for one
    participation), which starts L-BFGS near a good optimum (from equal weights it took about 7× the evaluations)."""
    from scipy.optimize import nnls

    scales = np.geomspace(2.0, max(float(n), 4.0), d)
    theta = 1.0 - 1.0 / scales
    m = min(n, 2000)
    c = np.cumprod(np.concatenate([[1.0], (2 * np.arange(1, m) - 1) / (2 * np.arange(1, m))]))
    omega, _ = nnls(theta[None, :] ** np.arange(m - 1)[:, None], c[1:])
    return np.log(theta / (1 - theta)), np.log(np.maximum(omega, 1e-6))


def blt_for_run(planned_steps: Optional[int], steps_per_epoch: int, min_separation: int) -> BLTParams:
    """The BLT a run uses: :func:`optimize_blt` for its planned steps (ten epochs when it has none), at most
    :data:`HORIZON_CAP` steps. What the Trainer, Fabric and the planner all call."""
    horizon = int(planned_steps) if planned_steps else 10 * max(int(steps_per_epoch), 1)
    return optimize_blt(min(horizon, HORIZON_CAP), int(min_separation))


def blt_sampler_kind(min_separation: int, params: BLTParams) -> str:
    """The ledger's sampler of cyclic sampling over b parts with BLT noise:
    ``"cyclic-blt:<b>:<θ,...>;<ω,...>"`` (each float in Python's round-tripping repr, so the ledger alone
    recomputes ε exactly).

    Example:
        >>> kind = blt_sampler_kind(4, BLTParams((0.5, 0.9), (0.1, 0.2))); kind
        'cyclic-blt:4:0.5,0.9;0.1,0.2'
        >>> blt_of(kind)
        (4, BLTParams(theta=(0.5, 0.9), omega=(0.1, 0.2)))
    """
    def text(xs: Sequence[float]) -> str:
        return ",".join(repr(float(x)) for x in xs)
    return f"{BLT_PREFIX}:{int(min_separation)}:{text(params.theta)};{text(params.omega)}"


def blt_of(sampler: str) -> Optional[tuple[int, BLTParams]]:
    """``(b, params)`` of a ``"cyclic-blt:..."`` sampler; None for any other sampler."""
    found = _KIND.match(str(sampler))
    if not found:
        return None
    return int(found.group(1)), BLTParams(tuple(float(x) for x in found.group(2).split(",")),
                                          tuple(float(x) for x in found.group(3).split(",")))
