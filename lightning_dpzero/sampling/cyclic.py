"""Cyclic Poisson sampling for banded matrix factorization (BandMF; Choquette-Choo et al., NeurIPS 2023, Alg. 2)
and BLT noise.

The training set is split once into b fixed, disjoint parts that cover it (:func:`cyclic_parts`: each example's part
drawn independently from ``partition_seed``, identical on every rank); optimizer step t Poisson-samples part ``t mod b`` at rate
``q_b = expected batch / (N / b) = b · q``. Every example is thus sampled at most once per round of b steps, which
is what lets a b-banded ``C`` keep each participation's sensitivity at C_clip (:mod:`..banded_mf`).

The partition seed must stay the same for the whole run, resumes included (the noise and sampling streams are
renewed on resume, the parts are not): record it with the run.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from ..accounting.banded import cyclic_sampler_kind
from .samplers import DistributedPoissonBatchSampler, _secure_uniform

__all__ = ["cyclic_parts", "CyclicPoissonBatchSampler"]


def cyclic_parts(num_samples: int, bands: int, partition_seed: int) -> list[np.ndarray]:
    """The b = ``bands`` parts (sorted int64 index arrays) of ``range(num_samples)``: each example is assigned to a
    part uniformly at random, independently of the others (from ``partition_seed``), so parts hold about N/b
    examples each. ``ValueError`` if b > N or b < 1.

    Why independent and not a permutation cut into equal pieces: ε is for adding or removing one example, and the
    privacy argument compares the two datasets with every other example in the same part. Independent assignment
    allows that (the added example draws its own part); equal pieces do not (one more example moves the cuts).

    Example:
        >>> parts = cyclic_parts(10, 3, partition_seed=0)
        >>> sorted(np.concatenate(parts).tolist()) == list(range(10)), len(parts)
        (True, 3)
    """
    if bands < 1 or bands > num_samples:
        raise ValueError(f"bands={bands} must be in [1, N={num_samples}]: each of the b parts needs an example.")
    assignment = np.random.default_rng([int(partition_seed), 0x42A4D]).integers(0, int(bands), size=int(num_samples))
    return [np.flatnonzero(assignment == p).astype(np.int64) for p in range(int(bands))]


class CyclicPoissonBatchSampler(DistributedPoissonBatchSampler):
    """:class:`DistributedPoissonBatchSampler` whose step t samples only the examples of part ``t mod b``, at rate
    ``q_b = b · sample_rate`` (so the expected batch stays ``sample_rate · N``).

    Args (beyond the Poisson sampler's, which see):
        bands: b >= 1 (1: Poisson sampling of the whole set).
        partition_seed: seed of the fixed parts; the same on every rank and across resumes.
        step_source: returns the run's optimizer steps so far (None: count from the epoch).

    Step t is the optimizer step's index in the whole run: ``step_source()`` when an epoch's iteration starts (the
    privacy ledger's step count, so a resumed or restarted epoch continues the parts where the noise is) plus the
    steps drawn since; without ``step_source``, ``epoch · steps_per_epoch + i``. Each micro-batch drawn queues its
    step index (:meth:`pop_step`), so the driver can check, before the update, that the batch's part is the one of
    the step the noise is at.

    Raises:
        ValueError: those of the Poisson sampler; ``b · sample_rate > 1``; ``bands`` > N.

    Example:
        >>> s = CyclicPoissonBatchSampler(num_samples=12, sample_rate=0.25, bands=2, partition_seed=1, seed=0)
        >>> parts = cyclic_parts(12, 2, 1)
        >>> all(set(b) <= set(parts[t % 2].tolist()) for t, b in enumerate(s))
        True
    """

    def __init__(self, num_samples: int, sample_rate: float, bands: int, partition_seed: int,
                 num_replicas: int = 1, rank: int = 0, accumulate_grad_batches: int = 1,
                 steps_per_epoch: int | None = None, seed: int = 0, secure_mode: bool = False,
                 shard_sizes: Sequence[int] | None = None, max_micro_batch_size: int | None = None,
                 step_source: Optional[Callable[[], int]] = None) -> None:
        super().__init__(num_samples, sample_rate, num_replicas, rank, accumulate_grad_batches, steps_per_epoch,
                         seed, secure_mode, None, max_micro_batch_size)
        if shard_sizes is not None or max_micro_batch_size is not None:
            raise ValueError("Cyclic Poisson sampling (noise_mechanism='banded-mf') does not support pre-sharded "
                             "data or max_micro_batch_size yet: use the DP strategy's own sampler over one dataset.")
        self.bands, self.partition_seed = int(bands), int(partition_seed)
        self.sampler_kind = cyclic_sampler_kind(self.bands)  # what the ledger charges: "cyclic-poisson:<b>"
        self.step_source = step_source
        self._drawn: deque[int] = deque()  # the step index of each micro-batch drawn and not yet run
        self.part_rate = self.bands * self.sample_rate
        if self.part_rate > 1:
            raise ValueError(f"q_b = bands · q = {self.bands} · {self.sample_rate:g} > 1: each part holds about "
                             "N/b examples, fewer than one expected batch. Use fewer bands or a smaller batch.")
        self.set_partition(self.partition_seed)

    def set_partition(self, partition_seed: int) -> None:
        """Use the parts of ``partition_seed`` (a resumed run's, from its ledger, when the loader was built before
        the checkpoint was loaded)."""
        self.partition_seed = int(partition_seed)
        mine = set(self.shard.tolist())  # this rank's examples r, r+W, ...: parts intersected with the shard
        self.rank_parts = [np.array([i for i in p.tolist() if i in mine], dtype=np.int64)
                           for p in cyclic_parts(self.num_samples, self.bands, self.partition_seed)]

    def __iter__(self) -> Iterator[list[int]]:
        gen = None if self.secure_mode else self._generator()
        k = self.accumulate_grad_batches
        start = self.epoch * self.steps_per_epoch if self.step_source is None else int(self.step_source())
        self._drawn.clear()  # a new iteration: micro-batches drawn by an abandoned one never run
        for i in range(self.steps_per_epoch):
            part = self.rank_parts[(start + i) % self.bands]
            uniforms = _secure_uniform(len(part)) if gen is None else gen.random(len(part))
            step = part[uniforms < self.part_rate]
            for chunk in np.array_split(step, k):
                self._drawn.append(start + i)
                yield chunk.tolist()

    def pop_step(self) -> Optional[int]:
        """The run's step index whose part the next micro-batch to run was drawn from (None: none queued)."""
        return self._drawn.popleft() if self._drawn else None
