"""Correlated noise: amplified banded matrix factorization (BandMF; Choquette-Choo, Ganesh, McKenna, McMahan,
Rush, Thakurta, Xu, "Amplified Banded Matrix Factorization", NeurIPS 2023).

DP-SGD releases ``g_t + z_t`` with independent ``z_t``. BandMF releases ``g_t + ν_t`` with ``ν = C⁻¹ z``, the
*correlated* noise of the matrix mechanism for the prefix-sum workload factorised as ``A = B C`` with ``B = A C⁻¹``
(the optimizer's sum of updates is the prefix sum), where

* ``C`` (T × T) is lower-triangular, Toeplitz and **b-banded**: ``C[t, t-j] = c_j`` for ``0 <= j < b``, else 0;
* ``c_j`` are the coefficients of ``(1 - x)^(-1/2)`` (``c_0 = 1``, ``c_j = c_{j-1}(2j-1)/(2j)``) truncated to b
  bands and normalised so ``Σ_j c_j² = 1``: every column of ``C`` has norm at most 1 (exactly 1 away from the end);
* ``z_t ~ N(0, σ² C_clip² I)`` i.i.d. (then divided by the expected batch, as DP-SGD's noise is).

**Scaling (why σ means the same as in DP-SGD).** The mechanism is equivalent to releasing ``C x + z`` for the
stacked gradients ``x`` (then post-processing by ``C⁻¹``). With *cyclic* Poisson sampling (:mod:`.sampling.cyclic`)
an example can only be sampled at steps ``t ≡ k (mod b)`` for its part ``k``, so two of its participations are at
least b steps apart; columns of a b-banded ``C`` that far apart have disjoint supports. Changing one example's
clipped gradient at one participation changes ``C x`` by ``C[:, t] · g`` with ``‖C[:, t]‖ <= 1`` and ``‖g‖ <= C_clip``,
so each participation has L2 sensitivity ``C_clip``, against noise ``σ C_clip``: each round of b steps is one
Poisson-sampled Gaussian mechanism with noise multiplier σ at the part's rate ``q_b`` (Theorem 4 of the paper).
The accountant composes ``⌈T / b⌉`` of them (:func:`banded_accounting_steps`).

**Recursion.** ``ν = C⁻¹ z`` is computed online: ``ν_t = (z_t - Σ_{j=1}^{b-1} c_j ν_{t-j}) / c_0``, keeping the
last ``b - 1`` noise vectors of the rank's own optimizer partition (memory per rank: ``(b-1)`` × the partition,
fp32). With ``b = 1``, ``c_0 = 1`` and ``ν_t = z_t``: DP-SGD exactly, the same draws.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import Optional

import numpy as np
import torch

from .blt import check_blt_supported

__all__ = ["banded_coefficients", "coefficients_digest", "banded_matrix", "banded_accounting_steps",
           "check_banded_supported", "BandedNoiseSource"]


def banded_coefficients(bands: int) -> np.ndarray:
    """The b = ``bands`` coefficients ``c_0..c_{b-1}`` (float64, shape ``(b,)``) of ``(1 - x)^(-1/2)`` normalised to
    unit L2 norm: the first column of the b-banded Toeplitz ``C``. ``ValueError`` for bands < 1.

    Example:
        >>> banded_coefficients(1).tolist()
        [1.0]
        >>> c = banded_coefficients(3); round(float((c ** 2).sum()), 12), bool(c[0] > c[1] > c[2] > 0)
        (1.0, True)
    """
    if isinstance(bands, bool) or not isinstance(bands, (int, np.integer)) or bands < 1:
        raise ValueError(f"bands={bands!r} must be an integer >= 1 (1 is DP-SGD's independent noise).")
    c = np.ones(int(bands), dtype=np.float64)
    for j in range(1, int(bands)):
        c[j] = c[j - 1] * (2 * j - 1) / (2 * j)
    return c / np.linalg.norm(c)


def coefficients_digest(bands: int) -> str:
    """SHA-256 (hex) of the coefficients' float64 bytes: what the ledger and checkpoints record, so a resume with
    other coefficients (another b, or another construction) is refused."""
    return hashlib.sha256(banded_coefficients(bands).tobytes()).hexdigest()


def banded_matrix(steps: int, bands: int) -> np.ndarray:
    """The ``steps × steps`` lower-triangular b-banded Toeplitz ``C`` (float64), for tests and analysis."""
    c = banded_coefficients(bands)
    m = np.zeros((steps, steps))
    for j, cj in enumerate(c):
        m += cj * np.eye(steps, k=-j)
    return m


def banded_accounting_steps(steps: int, bands: int) -> int:
    """``⌈steps / b⌉``: the number of Poisson-sampled Gaussian mechanisms (at rate ``q_b``) that ``steps`` BandMF
    steps compose to (one per round of b steps; each example is in one part, sampled once per round)."""
    return -(-int(steps) // int(bands))


def check_banded_supported(bands: int, steps_per_epoch: int, poisson_sampling: bool = True,
                           noise_mechanism: str = "banded-mf") -> None:
    """Refuse what the amplified BandMF analysis does not cover, before the first update.

    Raises:
        ValueError: ``bands`` > ``steps_per_epoch`` (a part would be sampled less than once per epoch and the
            parts would hold fewer examples than one expected batch: the rate ``q_b = b·B/N`` exceeds 1 or the
            analysis' min-separation no longer matches the epoch); ``poisson_sampling=False`` with b > 1
            (shuffled fixed-size batches have no amplification analysis with correlated noise).
    """
    check_blt_supported(bands) if noise_mechanism == "blt" else banded_coefficients(bands)
    if bands > 1 and not poisson_sampling:
        raise ValueError(f"noise_mechanism={noise_mechanism!r} with bands={bands} needs poisson_sampling=True: its privacy "
                         "analysis (cyclic Poisson sampling) does not cover fixed-size shuffled batches. Use "
                         "poisson_sampling=True, or bands=1 / noise_mechanism='dp-sgd'.")
    if bands > steps_per_epoch:
        raise ValueError(f"bands={bands} exceeds the {steps_per_epoch} steps per epoch: each of the b parts of the "
                         f"training set would be smaller than an expected batch (q_b = b·q > 1). Use bands <= "
                         f"{steps_per_epoch}, a smaller batch, or noise_mechanism='dp-sgd'.")


class BandedNoiseSource:
    """A noise source (the interface of :class:`lightning_dpzero.noise.NoiseSource`) whose draws are the BandMF
    noise ``ν_t = (z_t - Σ_{j=1}^{b-1} c_j ν_{t-j}) / c_0`` in units of the standard deviation (the hook multiplies
    by ``σ C_clip / B_exp``), ``z_t`` from ``base``.

    The noise pre-hook calls :meth:`begin_step` once per optimizer step, then :meth:`normal` once per parameter of
    the rank's partition in the optimizer's fixed order; the ``b - 1`` previous steps' tensors are kept on the
    partition's device (memory: ``(b-1)`` × partition numel × 4 bytes per rank).

    Args:
        base: the i.i.d. source of ``z`` (seeded or secure; partitioned or replicated as DP-SGD's).
        bands: b >= 1.

    Example:
        >>> from lightning_dpzero.noise import NoiseSource
        >>> src = BandedNoiseSource(NoiseSource(0, False, replicated=True, rank=0), bands=2)
        >>> src.begin_step(); a = src.normal((3,), "cpu"); src.begin_step(); b = src.normal((3,), "cpu")
        >>> ref = NoiseSource(0, False, replicated=True, rank=0); z0, z1 = ref.normal((3,), "cpu"), ref.normal((3,), "cpu")
        >>> c = banded_coefficients(2); bool(torch.allclose(b, (z1 - c[1] * a) / c[0]))
        True
    """

    def __init__(self, base, bands: int):
        self.base, self.bands = base, int(bands)
        self.coefficients = banded_coefficients(bands)
        self.secure_mode, self.replicated, self.rank = base.secure_mode, base.replicated, base.rank
        self.history: deque[list[torch.Tensor]] = deque(maxlen=max(self.bands - 1, 1))
        self.step = 0                          #: optimizer steps noised so far
        self._current: Optional[list[torch.Tensor]] = None

    def begin_step(self) -> None:
        """A new optimizer step: the previous step's noise joins the history."""
        if self._current is not None and self.bands > 1:
            self.history.appendleft(self._current)
        self._current = []
        self.step += 1

    def normal(self, shape, device) -> torch.Tensor:
        if self._current is None:
            self.begin_step()
        i = len(self._current)
        z = self.base.normal(shape, device)
        if self.bands == 1:
            self._current.append(z)
            return z
        acc = z.clone()
        for j, past in enumerate(self.history, start=1):
            if i >= len(past) or past[i].shape != z.shape:
                raise RuntimeError("BandMF noise: the optimizer's parameters changed between steps (the noise "
                                   "history is per parameter of a fixed partition); correlated noise needs the same "
                                   "parameters, in the same order, at every step.")
            acc.sub_(past[i].to(acc.device, acc.dtype), alpha=float(self.coefficients[j]))
        nu = acc / float(self.coefficients[0])
        self._current.append(nu.detach())
        return nu.to(z.dtype)

    # ----------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        """What a checkpoint of this rank holds to continue the noise exactly: mechanism, b, the coefficients'
        digest, the step, and the b-1 previous noise vectors (on CPU)."""
        past = ([] if self._current is None else [self._current]) + list(self.history)
        return {"noise_mechanism": "banded-mf", "bands": self.bands, "digest": coefficients_digest(self.bands),
                "step": self.step, "history": [[t.detach().cpu() for t in s] for s in past[:self.bands - 1]]}

    def load_state_dict(self, state: dict, device=None) -> None:
        """Continue from :meth:`state_dict`. ``ValueError`` if the checkpoint's mechanism, b or coefficients differ
        from this source's (a changed mechanism mid-run is not covered by the accounting)."""
        saved = (state.get("noise_mechanism"), state.get("bands"), state.get("digest"))
        mine = ("banded-mf", self.bands, coefficients_digest(self.bands))
        if saved != mine:
            raise ValueError(f"The checkpoint's noise was noise_mechanism={saved[0]!r}, bands={saved[1]!r}; this run "
                             f"has noise_mechanism='banded-mf', bands={self.bands}. Changing the mechanism or b on "
                             "resume is not covered by the privacy analysis: resume with the checkpoint's settings.")
        self.step = int(state["step"])
        self.history = deque([[t.to(device) if device is not None else t.clone() for t in s]
                              for s in state["history"]], maxlen=max(self.bands - 1, 1))
        self._current = None


def expected_noise_covariance(steps: int, bands: int, std: float) -> np.ndarray:
    """``std² · C⁻¹ C⁻ᵀ`` (steps × steps): the covariance over steps of one coordinate of the released noise."""
    inv = np.linalg.inv(banded_matrix(steps, bands))
    return std ** 2 * inv @ inv.T
