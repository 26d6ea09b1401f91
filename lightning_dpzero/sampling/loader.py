"""The DataLoader plumbing around the private samplers: N, the refusal of a sampling the accountant cannot
describe, and a user's DataLoader rebuilt over the same dataset with a private batch sampler."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, Sampler
from torch.utils.data._utils.collate import default_collate, default_convert

from .collate import empty_safe_collate
from .samplers import DistributedPoissonBatchSampler, DistributedShuffledBatchSampler, _ShardedBatchSampler

__all__ = ["private_dataloader", "dataset_size", "check_sampler_describable"]


def dataset_size(dataloader: DataLoader, shard: bool = False) -> int:
    """N = len(dataloader.dataset). Raises TypeError for an IterableDataset or a dataset without __len__, and
    ValueError for an empty one: Poisson sampling and the accountant both need N. ``shard``: the loader holds
    this rank's shard (``use_distributed_sampler=False``), which the messages then say."""
    dataset = getattr(dataloader, "dataset", None)
    if isinstance(dataset, IterableDataset):
        where = (" With use_distributed_sampler=False each rank's DataLoader must be a map-style Dataset "
                 "of that rank's shard: N is the sum of the shards' lengths, and each shard is Poisson-sampled by "
                 "index." if shard else "")
        raise TypeError("DP accounting needs the training set's size N; an IterableDataset has none and cannot be "
                        f"Poisson-sampled. Use a map-style Dataset (with __len__ and __getitem__).{where}")
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError as err:
        raise TypeError(f"DP accounting needs the training set's size N; {type(dataset).__name__} has no "
                        "__len__. Give the training dataset a __len__.") from err
    if n < 1:
        raise ValueError("DP accounting needs the training set's size N; the training dataset is empty." + (
            " With use_distributed_sampler=False every rank needs a non-empty shard." if shard else ""))
    return int(n)


def _describe_sampler(sampler: Any) -> tuple[Any, bool]:
    """(the sampler to name, whether it is one the DP sampler may replace). Lightning wraps a user's custom
    sampler in ``DistributedSamplerWrapper`` (a ``DistributedSampler`` over ``_DatasetSamplerWrapper``)."""
    from torch.utils.data import RandomSampler, SequentialSampler
    from torch.utils.data.distributed import DistributedSampler

    try:
        from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    except ImportError:  # pragma: no cover
        DistributedSamplerWrapper = ()  # type: ignore[assignment]
    if DistributedSamplerWrapper and isinstance(sampler, DistributedSamplerWrapper):
        inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)
        return _describe_sampler(inner) if inner is not None else (sampler, False)
    # exact types: a subclass may draw examples differently (weights, subsets, repeats, curricula)
    return sampler, type(sampler) in (RandomSampler, SequentialSampler, DistributedSampler)


def check_sampler_describable(dataloader: DataLoader) -> None:
    """Refuse a training DataLoader whose sampling the privacy accountant cannot describe.

    The DP strategy replaces the loader's sampling by Poisson sampling (each example joins each step
    independently with probability q), which is what the accountant charges. That is only a faithful
    replacement of plain shuffled or sequential batches: PyTorch's ``RandomSampler`` / ``SequentialSampler``
    with its ``BatchSampler``, or the ``DistributedSampler`` Lightning injects for them. A custom sampler or
    batch sampler (weighted, subset, bucketing, curriculum, ...) says which examples to train on and how often;
    silently dropping it would change the training, and keeping it would invalidate the accounting. A plain
    ``BatchSampler`` passed as ``batch_sampler=`` is refused too: the loader's ``batch_size`` is then None, and
    that is where the strategy reads the B from which it computes q.

    Raises:
        ValueError: naming the sampler's class and the fix (remove it and let the DP strategy sample).
    """
    from torch.utils.data import BatchSampler

    if isinstance(getattr(dataloader, "dataset", None), IterableDataset):
        return  # no sampler at all; `dataset_size` refuses it with its own message
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if batch_sampler is not None and not isinstance(batch_sampler, _ShardedBatchSampler) \
            and type(batch_sampler) is not BatchSampler:
        cls = type(batch_sampler)
        raise ValueError(
            f"The training DataLoader uses the custom batch sampler {cls.__module__}.{cls.__qualname__}, whose "
            "sampling the privacy accountant cannot describe. Remove batch_sampler=... and build the DataLoader "
            "with batch_size=B (the per-device micro-batch): the DP strategy replaces sampling with Poisson "
            "sampling (q = B x devices x accumulate_grad_batches / N), which is what the privacy ledger charges.")
    if isinstance(batch_sampler, _ShardedBatchSampler):
        return  # already private
    sampler, ok = _describe_sampler(getattr(batch_sampler, "sampler", None) if batch_sampler is not None
                                    else getattr(dataloader, "sampler", None))
    if sampler is not None and not ok:
        cls = type(sampler)
        raise ValueError(
            f"The training DataLoader uses the custom sampler {cls.__module__}.{cls.__qualname__}, whose sampling the "
            "privacy accountant cannot describe (it would be replaced, changing which examples are trained on, or "
            "kept, invalidating ε). Remove sampler=... (use shuffle=True or nothing): the DP strategy replaces "
            "sampling with Poisson sampling over the whole dataset (each example in each step with probability q), "
            "which is what the privacy ledger charges. To train on a subset, pass a torch.utils.data.Subset as the "
            "dataset so that N is its size.")
    if batch_sampler is not None and getattr(dataloader, "batch_size", None) != batch_sampler.batch_size:
        # batch_sampler=BatchSampler(...) given explicitly: the DataLoader's own batch_size is then None, not
        # the B the user meant. (Lightning's DistributedSampler injection, Trainer(use_distributed_sampler=True),
        # drops such a batch sampler and rebuilds the loader with batch_size=1 before any strategy hook sees it.)
        raise ValueError(
            f"The training DataLoader was built with batch_sampler=BatchSampler(sampler, "
            f"batch_size={batch_sampler.batch_size}, ...): the DP strategy replaces the batch sampler with Poisson "
            "sampling and takes the per-device micro-batch B from the DataLoader's batch_size, which is "
            f"{getattr(dataloader, 'batch_size', None)!r} here, so q and the batches would not be the ones you "
            f"asked for. Remove batch_sampler=... and build the DataLoader with "
            f"batch_size={batch_sampler.batch_size} (shuffle as you like; the order is replaced): q = B x devices "
            "x accumulate_grad_batches / N is what the privacy ledger charges.")


def private_dataloader(dataloader: DataLoader, sample_rate: float, num_replicas: int, rank: int,
                       accumulate_grad_batches: int = 1, seed: int = 0, secure_mode: bool = False,
                       poisson: bool = True, steps_per_epoch: int | None = None,
                       shard_sizes: Sequence[int] | None = None, max_micro_batch_size: int | None = None,
                       batch_sizes: Sequence[int] | None = None, cyclic: Mapping[str, Any] | None = None
                       ) -> DataLoader:
    """Rebuild a user's DataLoader over the same dataset with a private batch sampler.

    `poisson=True`: a `DistributedPoissonBatchSampler(N, sample_rate, ...)`, N = `dataset_size(dataloader)`, or
    with `shard_sizes` (each rank's loader holds its own shard) N = their sum.
    `poisson=False`: a `DistributedShuffledBatchSampler` with the loader's own `batch_size` per micro-batch
    (`batch_sizes`: every rank's, where they differ); `sample_rate` must then be the sampler's (B W K / N where
    the ranks agree, as from `poisson_sample_rate`; else :func:`shuffled_sample_rate`), else ValueError.
    `cyclic` (correlated noise, banded MF): ``{"bands": b, "partition_seed": s, "step_source": f}`` with b > 1:
    a :class:`~lightning_dpzero.sampling.cyclic.CyclicPoissonBatchSampler` (Poisson only; no shards, no bound).
    `max_micro_batch_size` (b): Poisson draws are truncated to K·b per rank and step (see the sampler); with
    fixed-size batches a b below the loader's `batch_size` is refused (ValueError) and any other b changes nothing.
    Kept: num_workers, collate_fn (wrapped by `empty_safe_collate`), pin_memory, timeout, worker_init_fn,
    multiprocessing_context, generator, prefetch_factor, persistent_workers, pin_memory_device, in_order.
    The user's sampler, shuffle, batch_size and drop_last are replaced. The result's `batch_sampler` carries
    `sampler_kind`, `sample_rate` and `expected_batch_size` for the ledger.
    """
    n = dataset_size(dataloader) if shard_sizes is None else sum(shard_sizes)
    if poisson and cyclic is not None and int(cyclic["bands"]) > 1:
        from .cyclic import CyclicPoissonBatchSampler

        batch_sampler: _ShardedBatchSampler = CyclicPoissonBatchSampler(
            n, sample_rate, num_replicas=num_replicas, rank=rank, accumulate_grad_batches=accumulate_grad_batches,
            steps_per_epoch=steps_per_epoch, seed=seed, secure_mode=secure_mode, shard_sizes=shard_sizes,
            max_micro_batch_size=max_micro_batch_size, **cyclic)
    elif poisson:
        batch_sampler = DistributedPoissonBatchSampler(
            n, sample_rate, num_replicas, rank, accumulate_grad_batches, steps_per_epoch, seed, secure_mode,
            shard_sizes, max_micro_batch_size)
    else:
        if dataloader.batch_size is None:
            raise ValueError("poisson_sampling=False needs the DataLoader's batch_size (the per-device "
                             "micro-batch); build the DataLoader with batch_size=B.")
        from ..accounting.truncation import check_fixed_size_bound  # scipy: imported when used, not at start

        check_fixed_size_bound(max_micro_batch_size, dataloader.batch_size)
        batch_sampler = DistributedShuffledBatchSampler(
            n, dataloader.batch_size, num_replicas, rank, accumulate_grad_batches, seed, secure_mode, shard_sizes,
            batch_sizes)
        if not math.isclose(batch_sampler.sample_rate, sample_rate, rel_tol=1e-9):
            raise ValueError(f"sample_rate={sample_rate} does not match batch_size x devices x "
                             f"accumulate_grad_batches / N = {batch_sampler.sample_rate}; pass "
                             "poisson_sample_rate(...) (shuffled_sample_rate(...) where the ranks' batch sizes "
                             "or shards differ) so the ledger records the q actually used.")
    return loader_with_sampler(dataloader, batch_sampler)


def loader_with_sampler(dataloader: DataLoader, batch_sampler: Sampler) -> DataLoader:
    """``dataloader`` over the same dataset with ``batch_sampler``, everything else kept as
    :func:`private_dataloader` lists (its collate made safe for an empty micro-batch)."""
    collate = dataloader.collate_fn
    if collate is default_convert:  # the user's loader had automatic batching off
        collate = default_collate
    kwargs: dict[str, Any] = dict(
        num_workers=dataloader.num_workers, collate_fn=empty_safe_collate(collate, dataloader.dataset),
        pin_memory=dataloader.pin_memory, timeout=dataloader.timeout, worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context, generator=dataloader.generator,
        persistent_workers=dataloader.persistent_workers,
        pin_memory_device=getattr(dataloader, "pin_memory_device", ""))
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    if hasattr(dataloader, "in_order"):
        kwargs["in_order"] = dataloader.in_order
    return DataLoader(dataloader.dataset, batch_sampler=batch_sampler, **kwargs)
