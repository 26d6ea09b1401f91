"""The training set as the ranks hold it: one global dataset, or one pre-built shard per rank.

With Lightning's default ``Trainer(use_distributed_sampler=True)`` every rank's DataLoader holds the whole
training set and the DP sampler shards it (rank r draws from examples r, r+W, ...): N is the dataset's length.
Large jobs often build each rank's DataLoader over that rank's own files instead and set
``use_distributed_sampler=False``. Then each loader holds one *shard*; N is the sum of the shards' lengths, and
Poisson-sampling every shard at the global q is exact Poisson subsampling of their union (each example lives in
one shard and joins each step independently with probability q), so the accountant's event is unchanged.

Counting N as that sum is only right if the shards are disjoint. The common mistake, every rank given the same
global dataset with ``use_distributed_sampler=False``, would count N W times and understate ε by a lot. So
every rank hashes its dataset's length and a few examples at fixed positions (read under fixed random seeds,
so random augmentations agree); ranks that agree on all of it hold the same dataset. Every rank the same: it
is one global dataset, sharded by the DP sampler as in the default path (with a warning). Some ranks the same
and others not: refused. The check cannot prove that different shards do not overlap (a shard that is a
reordered copy of another, or overlapping file lists): that stays the user's to ensure.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ._collectives import Collectives, gather_objects
from .sampling import check_sampler_describable, dataset_size, poisson_sample_rate, private_dataloader

__all__ = ["TrainingData", "describe_training_data", "dataset_digest", "warn_unequal_shuffled_shards",
           "private_training_loader"]

#: examples hashed per rank, at evenly spaced fixed positions (first and last included)
DIGEST_EXAMPLES = 8


@dataclass(frozen=True)
class TrainingData:
    """How the training set is held.

    Attributes:
        dataset_size: N, examples in the whole training set (all ranks).
        shard_sizes: ``None``: one global dataset on every rank, sharded by the DP sampler; else the length of
            each rank's own shard, in rank order (their sum is N).
    """

    dataset_size: int
    shard_sizes: Optional[tuple[int, ...]] = None


def _feed(h, obj: Any) -> None:
    """Hash ``obj`` by value: tensors and arrays by dtype, shape and bytes; containers recursively."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype}{obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, Mapping):
        h.update(b"M")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _feed(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for item in obj:
            _feed(h, item)
    else:
        h.update(repr(obj).encode())


def dataset_digest(dataset: Any, n: int) -> str:
    """SHA-256 of ``n`` and of ``DIGEST_EXAMPLES`` examples at evenly spaced positions, each read with Python's,
    NumPy's and PyTorch's global random generators seeded alike (restored afterwards).

    Example:
        >>> data = torch.utils.data.TensorDataset(torch.arange(10.0))
        >>> dataset_digest(data, 10) == dataset_digest(torch.utils.data.TensorDataset(torch.arange(10.0)), 10)
        True
        >>> dataset_digest(data, 10) == dataset_digest(torch.utils.data.TensorDataset(torch.arange(1.0, 11)), 10)
        False
    """
    h = hashlib.sha256(f"N{n}".encode())
    positions = sorted({round(i * (n - 1) / max(DIGEST_EXAMPLES - 1, 1)) for i in range(DIGEST_EXAMPLES)})
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            for i in positions:
                random.seed(i)
                np.random.seed(i)
                torch.manual_seed(i)
                _feed(h, dataset[i])
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
    return h.hexdigest()


def describe_training_data(dataloader: Any, world_size: int, pre_sharded: bool) -> TrainingData:
    """N and the sharding of the training set (see the module docstring). Every rank calls it (a gather).

    Args:
        dataloader: this rank's training DataLoader.
        world_size: W.
        pre_sharded: ``Trainer(use_distributed_sampler=False)``: each rank's loader may hold its own shard.

    Raises:
        TypeError: a dataset without a length (an IterableDataset): N cannot be known.
        ValueError: some ranks hold the same dataset and others not; an empty shard (on any rank: every rank
            raises).
    """
    if not pre_sharded or world_size == 1:
        return TrainingData(dataset_size(dataloader))
    try:  # every rank reaches the gather, even one whose shard is refused (a rank that raised alone would hang)
        n = dataset_size(dataloader, shard=True)
        mine: tuple = (n, dataset_digest(dataloader.dataset, n), None)
    except (TypeError, ValueError) as err:
        mine, refused = (0, "", f"{type(err).__name__}: {err}"), err
    found = gather_objects(mine, world_size)
    if mine[2] is not None:
        raise refused
    for rank, (_, _, error) in enumerate(found):
        if error is not None:
            raise ValueError(f"Rank {rank}'s training DataLoader was refused: {error}")
    digests = [d for _, d, _ in found]
    if len(set(digests)) == 1:
        # the usual case (use_distributed_sampler=False set for validation sharding, as the example configs do):
        # correct as it is, so said once in the log, not warned
        rank_zero_info(
            f"Trainer(use_distributed_sampler=False), but every one of the {world_size} ranks' training DataLoaders "
            f"holds the same dataset ({n} examples: the same length and the same examples). It is treated as one "
            f"global dataset of N = {n} examples that the DP sampler shards over the ranks (not {world_size} "
            f"shards of N = {n * world_size}, which would understate ε). To train on per-rank shards, give each "
            "rank's DataLoader its own, disjoint part of the data.")
        return TrainingData(n)
    same = [[r for r, d in enumerate(digests) if d == digest] for digest in dict.fromkeys(digests)]
    same = [ranks for ranks in same if len(ranks) > 1]
    if same:
        groups = "; ".join("ranks " + ", ".join(map(str, ranks)) for ranks in same)
        raise ValueError(
            f"Trainer(use_distributed_sampler=False): the training DataLoaders of {groups} hold the same dataset "
            "(the same length and the same examples), while other ranks hold other data. Each rank's DataLoader "
            "must hold its own, disjoint shard of the training set (N is the sum of the shards), or every rank the "
            "same global dataset (Trainer(use_distributed_sampler=True) then shards it). Nothing was trained.")
    return TrainingData(sum(s for s, _, _ in found), tuple(s for s, _, _ in found))


def warn_unequal_shuffled_shards(shard_sizes: tuple[int, ...], per_rank_step: int, sample_rate: float) -> None:
    """Fixed-size shuffled batches over shards of unequal size: an example of a shard of n_r examples is in
    ``per_rank_step / n_r`` of the steps (B·K examples per rank and step), above the q = B·W·K/N the ledger
    charges when the shard is smaller than average; warn with the largest such rate."""
    smallest = min(shard_sizes)
    rate = per_rank_step / smallest
    if rate > sample_rate * (1 + 1e-9):
        rank_zero_warn(
            f"poisson_sampling=False over shards of unequal size {list(shard_sizes)}: an example of the smallest "
            f"shard ({smallest} examples) is in {rate:.4g} of the steps, above the q = {sample_rate:.4g} the ledger "
            "charges (the average over shards). Use poisson_sampling=True (each shard sampled at q: exact), or "
            "shards of equal size.")


def private_training_loader(dataloader: Any, collectives: Collectives, accumulate_grad_batches: int, *,
                            pre_sharded: bool, poisson: bool, seed: int, secure_mode: bool,
                            max_micro_batch_size: Optional[int]) -> Any:
    """The training loader over the same dataset with the distributed Poisson (``poisson``, else shuffled)
    sampler at ``q = B·W·K/N``, B being ``dataloader.batch_size``. ``pre_sharded``
    (``Trainer(use_distributed_sampler=False)``): each rank's loader may hold its own shard, N is then the sum
    over ranks (:func:`describe_training_data`). ``max_micro_batch_size``: the bound of
    :class:`~lightning_dpzero.sampling.DistributedPoissonBatchSampler`.

    Raises:
        TypeError: the dataset has no ``__len__`` (N is needed).
        ValueError: no ``batch_size``, a sampler the accountant cannot describe, q > 1, or shards of which
            some ranks hold the same dataset.
    """
    check_sampler_describable(dataloader)
    world, rank = collectives.world_size, collectives.global_rank
    data = describe_training_data(dataloader, world, pre_sharded)
    batch_size = getattr(dataloader, "batch_size", None)
    if batch_size is None:
        raise ValueError("The training DataLoader must be built with batch_size=B (the per-device "
                         "micro-batch): the DP sampler replaces its sampler and needs B to set q.")
    q = poisson_sample_rate(batch_size, world, accumulate_grad_batches, data.dataset_size)
    if data.shard_sizes is not None and not poisson:
        warn_unequal_shuffled_shards(data.shard_sizes, batch_size * accumulate_grad_batches, q)
    return private_dataloader(dataloader, q, world, rank, accumulate_grad_batches, seed=seed,
                              secure_mode=secure_mode, poisson=poisson, shard_sizes=data.shard_sizes,
                              max_micro_batch_size=max_micro_batch_size)
