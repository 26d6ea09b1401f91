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
import secrets
from collections import deque
from typing import Any, Callable, Optional

import numpy as np
import torch

from .util.options import NoiseMechanism, check_option

__all__ = ["NoiseMechanism", "banded_coefficients", "coefficients_digest", "banded_matrix", "banded_accounting_steps",
           "check_banded_supported", "BandedNoiseSource", "CorrelatedNoise"]


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


def check_banded_supported(bands: int, steps_per_epoch: int, poisson_sampling: bool = True) -> None:
    """Refuse what the amplified BandMF analysis does not cover, before the first update.

    Raises:
        ValueError: ``bands`` > ``steps_per_epoch`` (a part would be sampled less than once per epoch and the
            parts would hold fewer examples than one expected batch: the rate ``q_b = b·B/N`` exceeds 1 or the
            analysis' min-separation no longer matches the epoch); ``poisson_sampling=False`` with b > 1
            (shuffled fixed-size batches have no amplification analysis with correlated noise).
    """
    banded_coefficients(bands)
    if bands > 1 and not poisson_sampling:
        raise ValueError(f"noise_mechanism='banded-mf' with bands={bands} needs poisson_sampling=True: its privacy "
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



class CorrelatedNoise:
    """The noise mechanism of a run, as :class:`~lightning_dpzero.mechanism.DPMechanism` uses it: DP-SGD's
    independent noise (``"dp-sgd"``, the default: every method is then a no-op) or BandMF (``"banded-mf"``).

    For BandMF it holds what must outlive one noise source: the fixed partition of the training set into b parts
    (its seed, recorded in the ledger and taken from it on resume), the noise history (from the live source or a
    checkpoint), and the check that each micro-batch was drawn from the part of the step being charged.

    Args:
        noise_mechanism: ``"dp-sgd"`` or ``"banded-mf"``.
        bands: b >= 1 for ``"banded-mf"`` (required); must be None (or 1) for ``"dp-sgd"``.
        poisson_sampling, privacy_unit, max_micro_batch_size: the run's settings; BandMF's analysis (cyclic
            Poisson sampling of examples) covers Poisson sampling of examples without a micro-batch bound only.

    Raises:
        ValueError: an unknown mechanism; bands missing, not an integer >= 1, or given for DP-SGD; BandMF (b > 1)
            with fixed-size batches, user-level DP or a micro-batch bound.

    Example:
        >>> CorrelatedNoise("banded-mf", 4).record(partition_seed=7)["bands"]
        4
        >>> CorrelatedNoise("banded-mf", None)
        Traceback (most recent call last):
        ...
        ValueError: noise_mechanism='banded-mf' needs bands=b, the number of bands of C (and of fixed parts the training set is split into): e.g. bands=4; bands=1 is DP-SGD.
    """

    def __init__(self, noise_mechanism: str = "dp-sgd", bands: Optional[int] = None, *, poisson_sampling: bool = True,
                 privacy_unit: str = "example", max_micro_batch_size: Optional[int] = None) -> None:
        self.noise_mechanism = check_option("noise_mechanism", noise_mechanism, NoiseMechanism)
        self.partition_seed: Optional[int] = None
        self.source: Optional[BandedNoiseSource] = None
        self._pending: Optional[dict] = None  # a checkpoint's noise state, for the next source
        self._steps: list[int] = []           # the step index of each micro-batch run since the last charge
        if self.noise_mechanism == "dp-sgd":
            if bands not in (None, 1):
                raise ValueError(f"bands={bands!r} is for noise_mechanism='banded-mf'; DP-SGD has no bands. Pass "
                                 "noise_mechanism='banded-mf' too, or drop bands.")
            self.bands = 1
            return
        if bands is None:
            raise ValueError("noise_mechanism='banded-mf' needs bands=b, the number of bands of C (and of fixed parts "
                             "the training set is split into): e.g. bands=4; bands=1 is DP-SGD.")
        banded_coefficients(bands)
        self.bands = int(bands)
        if self.bands > 1:
            why = ("poisson_sampling=False" if not poisson_sampling else
                   "privacy_unit='user'" if privacy_unit != "example" else
                   "max_micro_batch_size" if max_micro_batch_size is not None else None)
            if why is not None:
                raise ValueError(f"noise_mechanism='banded-mf' with bands={self.bands} does not support {why}: its "
                                 "privacy analysis covers cyclic Poisson sampling of examples, without a micro-batch "
                                 f"bound. Drop {why}, or use noise_mechanism='dp-sgd'.")

    @property
    def banded(self) -> bool:
        return self.noise_mechanism == "banded-mf"

    @property
    def cyclic(self) -> bool:
        """Whether the sampler must be cyclic (b > 1)."""
        return self.banded and self.bands > 1

    def record(self, partition_seed: Optional[int] = None) -> Optional[dict]:
        """What the ledger records (hashed): mechanism, b, the coefficients' digest, the partition seed (None for
        DP-SGD)."""
        if not self.banded:
            return None
        seed = self.partition_seed if partition_seed is None else partition_seed
        return {"mechanism": "banded-mf", "bands": self.bands, "coefficients_digest": coefficients_digest(self.bands),
                "partition_seed": None if seed is None else int(seed)}

    def check_restored(self, restored: Optional[dict]) -> None:
        """Refuse a resume whose ledger was written with another mechanism, b or coefficients."""
        mine = self.record(partition_seed=-1)
        theirs = None if restored is None else {**restored, "partition_seed": -1}
        if mine != theirs:
            def text(m):
                return "noise_mechanism='dp-sgd'" if m is None else f"noise_mechanism='banded-mf', bands={m['bands']}"
            raise ValueError(f"The checkpoint's privacy ledger was written with {text(restored)}; this run has "
                             f"{text(mine)}. Changing the noise mechanism or b on resume is not covered by the privacy "
                             "analysis: resume with the checkpoint's settings.")

    def fix_partition(self, restored: Optional[dict], seed: Optional[int], broadcast: Callable[[int], int]) -> None:
        """The partition seed: the restored ledger's (a resume keeps the parts), the run's seed, or OS entropy
        shared by the ranks."""
        if not self.banded or self.partition_seed is not None:
            return
        if restored is not None and restored.get("partition_seed") is not None:
            self.partition_seed = int(restored["partition_seed"])
        else:
            self.partition_seed = int(seed) if seed is not None else int(broadcast(secrets.randbits(62)))

    def sampler_options(self, step_source: Callable[[], int]) -> Optional[dict]:
        """The ``cyclic`` argument of ``private_dataloader`` (None: an ordinary sampler)."""
        if not self.cyclic:
            return None
        return {"bands": self.bands, "partition_seed": self.partition_seed, "step_source": step_source}

    def wrap(self, base) -> Any:
        """The noise source of a run: ``base`` itself (DP-SGD), or a :class:`BandedNoiseSource` over it that
        continues the checkpoint's noise history (after a load) or the previous source's (a later fit)."""
        if not self.banded:
            return base
        previous, self.source = self.source, BandedNoiseSource(base, self.bands)
        if self._pending is not None:
            self.source.load_state_dict(self._pending)
            self._pending = None
        elif previous is not None:
            self.source.load_state_dict(previous.state_dict())
        return self.source

    def state_dict(self) -> Optional[dict]:
        """This rank's noise state for a checkpoint (None: DP-SGD, or nothing noised yet)."""
        return self.source.state_dict() if self.banded and self.source is not None else None

    def load(self, state: Optional[dict], steps: int, rank: int, restored: Optional[dict] = None,
             sampler: Any = None) -> None:
        """A checkpoint was loaded whose ledger has ``steps`` steps and records ``restored`` (its
        ``noise_mechanism``): its partition is the run's from now on (also for a ``sampler`` built before the load,
        as a Fabric loop builds it), and its noise state ``state`` (this rank's) is the history the next source
        continues. ``ValueError`` if BandMF's state is missing or for another mechanism."""
        if not self.banded:
            return
        if restored is not None and restored.get("partition_seed") is not None:
            self.partition_seed = int(restored["partition_seed"])
            if hasattr(sampler, "set_partition"):
                sampler.set_partition(self.partition_seed)
        if state is None:
            if steps == 0 or self.bands == 1:
                self._pending = None
                return
            raise ValueError(f"The checkpoint holds no BandMF noise state for rank {rank}, so the correlated noise "
                             "cannot continue (a checkpoint written without noise_mechanism='banded-mf', or by "
                             "another number of processes). Resume from a checkpoint of this run.")
        BandedNoiseSource(_NoBase(), self.bands).load_state_dict(state)  # refuses another mechanism or b now
        self._pending = state

    def note_micro_batch(self, sampler: Any) -> None:
        """A micro-batch is about to run: the step index the cyclic ``sampler`` drew it for."""
        if self.cyclic and sampler is not None and hasattr(sampler, "pop_step"):
            found = sampler.pop_step()
            if found is not None:
                self._steps.append(found)

    def check_step(self, step: int) -> None:
        """Before step ``step`` (0-based) is charged and applied: every micro-batch of it came from part
        ``step mod b``. ``RuntimeError`` otherwise (a batch drawn for another step: the separation of an example's
        participations, on which the noise's sensitivity rests, would not hold)."""
        drawn, self._steps = self._steps, []
        wrong = sorted({t for t in drawn if t % self.bands != step % self.bands})
        if wrong:
            raise RuntimeError(f"noise_mechanism='banded-mf': optimizer step {step} ran micro-batches drawn for "
                               f"step(s) {wrong} (part {wrong[0] % self.bands} instead of {step % self.bands}), so an "
                               "example could take part twice within b steps. Train on the loader the strategy "
                               "builds, without skipping or reordering its batches.")

    def check_precision(self, fp16: bool) -> None:
        """Refuse DeepSpeed's fp16 (a skipped overflow step would leave the noise history behind the parts)."""
        if self.cyclic and fp16:
            raise ValueError("noise_mechanism='banded-mf' does not support DeepSpeed's fp16 with dynamic loss "
                             "scaling: an overflow skips an update that the parts' schedule counts. Use "
                             "precision='bf16-mixed' or 32, or noise_mechanism='dp-sgd'.")


class _NoBase:
    secure_mode, replicated, rank = False, True, 0
