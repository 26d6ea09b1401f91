"""Distributed Poisson subsampling for DP-SGD, its fixed-size shuffled alternative, and the sample rate q of
each.

DP-SGD (Abadi et al., "Deep Learning with Differential Privacy", CCS 2016) is accounted as a composition of
*Poisson-subsampled* Gaussian mechanisms (Mironov, Talwar, Zhang, "Rényi Differential Privacy of the Sampled
Gaussian Mechanism", 2019): at every optimizer step each of the N training examples joins the logical batch
independently with probability q. The privacy guarantee reported by the accountant holds for that sampling,
so the sampler below draws exactly it, sharded over ranks so no example is seen by two ranks.

Every rank yields the same number of (possibly empty) micro-batches per epoch: a rank that skipped an empty
batch would leave its peers waiting in a collective forever. The DataLoader around a sampler: ``loader.py``.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

__all__ = ["DistributedPoissonBatchSampler", "DistributedShuffledBatchSampler", "poisson_sample_rate",
           "shuffled_sample_rate"]


def _check_int(name: str, value: Any, low: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}. {fix}")
    return int(value)


def _secure_uniform(n: int) -> np.ndarray:
    """n uniforms in [0, 1) with 53 random bits each, from the OS CSPRNG (no seed, not reproducible)."""
    raw = np.frombuffer(os.urandom(8 * n), dtype=np.uint64)
    return (raw >> np.uint64(11)).astype(np.float64) * 2.0**-53


def random_subset(n: int, size: int, gen: np.random.Generator | None) -> np.ndarray:
    """``size`` of the positions ``0..n-1``, uniformly without replacement, sorted; from ``gen``, or from the OS
    CSPRNG where ``gen`` is None (secure mode)."""
    if gen is None:
        keep = np.argsort(np.frombuffer(os.urandom(8 * n), dtype=np.uint64), kind="stable")[:size]
    else:
        keep = gen.choice(n, size=size, replace=False)
    return np.sort(keep)


class _ShardedBatchSampler(Sampler[list[int]]):
    """Shared plumbing: rank r owns indices r, r+W, r+2W, ... of one global dataset, or (``shard_sizes``) all
    ``shard_sizes[r]`` indices of its own dataset, a shard of the training set; epochs; (seed, epoch, rank)
    generators."""

    sampler_kind = "base"

    def __init__(self, num_samples: int, num_replicas: int, rank: int, accumulate_grad_batches: int,
                 seed: int, secure_mode: bool, shard_sizes: Sequence[int] | None = None) -> None:
        super().__init__()
        self.num_samples = _check_int("num_samples", num_samples, 1, "The training set must not be empty.")
        self.num_replicas = _check_int("num_replicas", num_replicas, 1, "Pass the world size (devices x nodes).")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_replicas:
            raise ValueError(f"`rank` must be in [0, num_replicas={num_replicas}), got {rank!r}. "
                             "Pass this process's global rank.")
        self.rank = int(rank)
        self.accumulate_grad_batches = _check_int("accumulate_grad_batches", accumulate_grad_batches, 1,
                                                  "Use 1 for no gradient accumulation.")
        self.seed, self.secure_mode = int(seed), bool(secure_mode)
        self.epoch, self._passes = 0, 0
        self.shard_sizes = None if shard_sizes is None else tuple(int(s) for s in shard_sizes)
        if self.shard_sizes is None:
            self.shard = np.arange(self.rank, self.num_samples, self.num_replicas, dtype=np.int64)
        else:
            if len(self.shard_sizes) != self.num_replicas or sum(self.shard_sizes) != self.num_samples \
                    or min(self.shard_sizes) < 1:
                raise ValueError(f"`shard_sizes` must hold num_replicas={self.num_replicas} sizes >= 1 that sum to "
                                 f"num_samples={self.num_samples}, got {list(self.shard_sizes)}.")
            self.shard = np.arange(self.shard_sizes[self.rank], dtype=np.int64)

    @property
    def rank_sizes(self) -> tuple[int, ...]:
        """The number of examples each rank samples from, in rank order (``shard_sizes``, or the r, r+W, ...
        split of N): what the truncation bound of ``max_micro_batch_size`` is computed over."""
        from ..accounting.truncation import rank_sizes_of  # scipy: imported when a bound is computed, not at start

        return rank_sizes_of(self.num_samples, self.num_replicas, self.shard_sizes)

    @property
    def sampler(self) -> _ShardedBatchSampler:
        # Lightning calls `set_epoch` on `dataloader.batch_sampler.sampler` at each epoch start; point it here.
        return self

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's stream, as `DistributedSampler.set_epoch`. Iterating again without calling it
        draws a fresh stream (never a replay of the same batches), still reproducible from the seed."""
        self.epoch, self._passes = int(epoch), 0

    def _generator(self) -> np.random.Generator:
        gen = np.random.default_rng([self.seed, self.epoch, self.rank, self._passes])
        self._passes += 1
        return gen

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulate_grad_batches


class _PoissonSizes:
    """The sizes of a Poisson sampler with ``sample_rate`` q over ``num_samples`` N (examples, or users)."""

    @property
    def expected_batch_size(self) -> float:
        """q * N: the expected logical batch per optimizer step over all ranks and micro-batches."""
        return self.sample_rate * self.num_samples

    @property
    def batch_size(self) -> int:
        """Nominal per-rank micro-batch, max(1, round(q N / (W K))), for throughput logging only: real batches vary."""
        return max(1, round(self.expected_batch_size / (self.num_replicas * self.accumulate_grad_batches)))


class DistributedPoissonBatchSampler(_PoissonSizes, _ShardedBatchSampler):
    """Poisson subsampling (each example independently with probability q) for DP-SGD, sharded over ranks.

    Args:
        num_samples: N, the size of the whole training set (all ranks), >= 1.
        sample_rate: q in (0, 1], the inclusion probability of each example at each optimizer step.
        num_replicas: W, the number of ranks. Rank r owns the disjoint shard r, r+W, r+2W, ... of the dataset
            (or, with ``shard_sizes``, the whole of its own dataset).
        rank: this process's rank in [0, W).
        accumulate_grad_batches: K >= 1. One optimizer step's sample on this rank (sorted indices) is split
            into K consecutive micro-batches whose sizes differ by at most one; some may be empty.
        steps_per_epoch: optimizer steps per epoch; default max(1, round(1/q)), one expected pass over the data.
        seed: with `epoch` and `rank`, seeds a `numpy.random.Generator`, so runs reproduce.
        secure_mode: draw inclusions from the OS CSPRNG (`os.urandom`); the seed is then ignored and no run can
            be reproduced, which is the point: an attacker who knows the seed learns nothing about the batches.
        shard_sizes: pre-sharded data (``Trainer(use_distributed_sampler=False)``): the length of each rank's own
            dataset, in rank order, summing to N. Each shard is sampled at the same q, which is exact Poisson
            subsampling of their union; every rank still yields the same number of micro-batches.
        max_micro_batch_size: b, or None (default: unbounded). When a rank's step sample holds more than K·b
            examples, a uniformly random subset of K·b of them is kept (drawn from the same generator, or the
            CSPRNG in secure mode; still sorted), so no micro-batch holds more than b. The accountant charges
            the probability of that in δ (:mod:`lightning_dpzero.accounting.truncation`; docs/privacy.md,
            *Bounded micro-batches*).

    Yields `len(self) = steps_per_epoch * K` lists of indices per epoch on every rank, empty lists included.
    The expected logical batch over all ranks is `expected_batch_size = q * N`; the mechanism divides by it,
    whatever batch was realised.

    Raises:
        ValueError: num_samples < 1, q not in (0, 1], rank not in [0, W), K < 1, steps_per_epoch < 1 or
            max_micro_batch_size < 1.

    Example:
        >>> sampler = DistributedPoissonBatchSampler(num_samples=100, sample_rate=0.1, num_replicas=2, rank=0,
        ...                                          seed=0)
        >>> len(sampler), sampler.expected_batch_size   # 10 steps per epoch; q·N over both ranks
        (10, 10.0)
        >>> all(i % 2 == 0 for batch in sampler for i in batch)  # rank 0 draws from its shard 0, 2, 4, ...
        True
    """

    sampler_kind = "poisson"

    def __init__(self, num_samples: int, sample_rate: float, num_replicas: int = 1, rank: int = 0,
                 accumulate_grad_batches: int = 1, steps_per_epoch: int | None = None,
                 seed: int = 0, secure_mode: bool = False, shard_sizes: Sequence[int] | None = None,
                 max_micro_batch_size: int | None = None) -> None:
        super().__init__(num_samples, num_replicas, rank, accumulate_grad_batches, seed, secure_mode, shard_sizes)
        self.max_micro_batch_size = None if max_micro_batch_size is None else _check_int(
            "max_micro_batch_size", max_micro_batch_size, 1, "It is the most examples one micro-batch may hold.")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
            raise ValueError(f"`sample_rate` must be in (0, 1], got {sample_rate!r}. It is q = expected batch / N; "
                             "use a smaller batch size or fewer devices/accumulation steps.")
        self.sample_rate = float(sample_rate)
        if steps_per_epoch is None:
            steps_per_epoch = max(1, round(1.0 / self.sample_rate))
        self.steps_per_epoch = _check_int("steps_per_epoch", steps_per_epoch, 1, "Leave it None for round(1/q).")

    def __iter__(self) -> Iterator[list[int]]:
        gen = None if self.secure_mode else self._generator()
        n, k = len(self.shard), self.accumulate_grad_batches
        cap = None if self.max_micro_batch_size is None else self.max_micro_batch_size * k
        for _ in range(self.steps_per_epoch):
            uniforms = _secure_uniform(n) if gen is None else gen.random(n)
            step = self.shard[uniforms < self.sample_rate]
            if cap is not None and len(step) > cap:
                # a uniformly random K·b-subset, kept in order; np.array_split then gives each micro-batch <= b
                step = step[random_subset(len(step), cap, gen)]
            for chunk in np.array_split(step, k):
                yield chunk.tolist()


class DistributedShuffledBatchSampler(_ShardedBatchSampler):
    """Fixed-size shuffled batches (the common q = B W K / N approximation of Poisson sampling).

    Each rank shuffles its own shard (r, r+W, ...; truncated to N // W so ranks agree; or, with `shard_sizes`,
    its own dataset) every epoch and yields `steps_per_epoch * K` micro-batches of exactly its `batch_size`
    indices, dropping the remainder (steps per epoch: the fewest any rank's shard allows, so all ranks agree).
    `batch_sizes`: every rank's micro-batch in rank order, where ranks differ (default: `batch_size` on every
    rank); `sample_rate` is then the largest rate at which any rank draws its examples
    (:func:`shuffled_sample_rate`). The ledger must record `sampler_kind = "shuffle"`: the Poisson accounting
    is then an approximation.

    Raises:
        ValueError: invalid sizes (as the Poisson sampler), `batch_sizes` of another length than W or without
            `batch_size` at `rank`, or a rank's batch_size * K larger than its N // W (or its shard).

    Example:
        >>> sampler = DistributedShuffledBatchSampler(num_samples=100, batch_size=4, num_replicas=2, rank=1)
        >>> len(sampler), sampler.sample_rate, {len(batch) for batch in sampler}
        (12, 0.08, {4})
    """

    sampler_kind = "shuffle"

    def __init__(self, num_samples: int, batch_size: int, num_replicas: int = 1, rank: int = 0,
                 accumulate_grad_batches: int = 1, seed: int = 0, secure_mode: bool = False,
                 shard_sizes: Sequence[int] | None = None, batch_sizes: Sequence[int] | None = None) -> None:
        super().__init__(num_samples, num_replicas, rank, accumulate_grad_batches, seed, secure_mode, shard_sizes)
        self.batch_size = _check_int("batch_size", batch_size, 1, "Pass the per-device micro-batch size.")
        self.batch_sizes = (self.batch_size,) * self.num_replicas if batch_sizes is None else tuple(
            _check_int("batch_sizes", b, 1, "Pass every rank's micro-batch size.") for b in batch_sizes)
        if len(self.batch_sizes) != self.num_replicas or self.batch_sizes[self.rank] != self.batch_size:
            raise ValueError(f"`batch_sizes` must hold num_replicas={self.num_replicas} sizes with batch_size="
                             f"{self.batch_size} at rank {self.rank}, got {list(self.batch_sizes)}.")
        pools = [self.num_samples // self.num_replicas] * self.num_replicas if shard_sizes is None \
            else list(self.shard_sizes)
        k = self.accumulate_grad_batches
        steps = [pool // (b * k) for pool, b in zip(pools, self.batch_sizes)]
        self.steps_per_epoch = min(steps)
        if self.steps_per_epoch < 1:
            r = steps.index(0)
            raise ValueError(f"batch_size={self.batch_sizes[r]} x accumulate_grad_batches={k} exceeds the "
                             f"{pools[r]} examples of rank {r} (dataset size {num_samples} over {num_replicas} "
                             "devices): lower the batch size, devices or accumulate_grad_batches.")

    @property
    def expected_batch_size(self) -> int:
        """K·ΣB_r (B * W * K where the ranks agree): the logical batch per optimizer step over all ranks."""
        return sum(self.batch_sizes) * self.accumulate_grad_batches

    @property
    def sample_rate(self) -> float:
        return shuffled_sample_rate(self.batch_sizes, self.accumulate_grad_batches, self.num_samples,
                                    self.shard_sizes)

    def __iter__(self) -> Iterator[list[int]]:
        shard = self.shard if self.shard_sizes is not None else self.shard[: self.num_samples // self.num_replicas]
        if self.secure_mode:
            order = np.argsort(np.frombuffer(os.urandom(8 * len(shard)), dtype=np.uint64), kind="stable")
        else:
            order = self._generator().permutation(len(shard))
        b = self.batch_size
        for i in range(len(self)):
            yield shard[order[i * b:(i + 1) * b]].tolist()


def shuffled_sample_rate(batch_sizes: Sequence[int], accumulate_grad_batches: int, dataset_size: int,
                         shard_sizes: Sequence[int] | None = None) -> float:
    """q charged for fixed-size shuffled batches: the largest rate ``K·B_r / n_r`` at which a rank r draws the
    examples of its share n_r of the data (its shard, or N / W of one global dataset), so that no example is
    drawn more often than the ledger says. Ranks that agree on B, with one global dataset or shards of equal
    size, give ``B·W·K / N``. ``batch_sizes``: every rank's micro-batch B_r, in rank order.

    Example:
        >>> shuffled_sample_rate([4, 4], 1, 64), shuffled_sample_rate([4, 4], 1, 64, shard_sizes=[16, 48])
        (0.125, 0.25)
    """
    w, k = len(batch_sizes), accumulate_grad_batches
    if shard_sizes is None:
        return max(b * w * k / dataset_size for b in batch_sizes)  # b·W·K/N: the product as poisson_sample_rate's
    return max(b * k / n for b, n in zip(batch_sizes, shard_sizes))


def poisson_sample_rate(batch_size: int | Sequence[int], num_replicas: int, accumulate_grad_batches: int,
                        dataset_size: int) -> float:
    """q = batch_size * W * K / N, so the expected logical batch q N equals the nominal B W K. ``batch_size``
    may be every rank's micro-batch B_r in rank order (ranks that differ): q = K·ΣB_r / N, the one rate at which
    every rank then samples, whose expected logical batch is K·ΣB_r.

    Raises:
        ValueError: a size < 1, W sizes not given for W ranks, or q > 1 (the logical batch exceeds the dataset).
    """
    w = _check_int("num_replicas", num_replicas, 1, "Pass the number of devices.")
    per_rank = not isinstance(batch_size, (int, np.integer))
    sizes = [_check_int("batch_size", b, 1, "Pass the per-device micro-batch size.")
             for b in (batch_size if per_rank else [batch_size])]
    if per_rank and len(sizes) != w:
        raise ValueError(f"{len(sizes)} batch sizes for num_replicas={w} ranks; pass one per rank.")
    k = _check_int("accumulate_grad_batches", accumulate_grad_batches, 1, "Use 1 for no accumulation.")
    n = _check_int("dataset_size", dataset_size, 1, "The training set must not be empty.")
    b = sum(sizes) if per_rank else sizes[0] * w  # B·W, or ΣB_r
    q = b * k / n
    if q > 1:
        what = (f"the ranks' batch sizes {sizes} (sum {b})" if per_rank and len(set(sizes)) > 1
                else f"batch_size {sizes[0]} x devices {w}")
        raise ValueError(f"Sample rate q = {what} x accumulate_grad_batches {k} / dataset size {n} = {q:.3g} > 1: "
                         "the logical batch exceeds the dataset. Lower batch_size, devices or "
                         "accumulate_grad_batches.")
    return q
