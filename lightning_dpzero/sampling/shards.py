"""The training set as the ranks hold it: one global dataset, or one pre-built shard per rank, and the one q
every rank samples at (docs/design.md, *Where each piece runs*: the training loader).

With Lightning's default ``Trainer(use_distributed_sampler=True)`` every rank's DataLoader holds the whole
training set and the DP sampler shards it (rank r draws from examples r, r+W, ...): N is the dataset's length.
Large jobs often build each rank's DataLoader over that rank's own files instead and set
``use_distributed_sampler=False`` (Fabric: ``fabric.setup_dataloaders(..., use_distributed_sampler=False)``).
Then each loader holds one *shard*; N is the sum of the shards' lengths, and Poisson-sampling every shard at the
global q is exact Poisson subsampling of their union (each example lives in one shard and joins each step
independently with probability q), so the accountant's event is unchanged.

**One q for every example.** Before the ledger opens, the ranks gather, in one gather, what each holds: its
micro-batch B_r, its dataset's length, its DP settings (K, sampler, micro-batch bound) and, for shards, the
dataset's identity. Every rank then computes the same N and the same q from all of them, q = K·ΣB_r/N (ranks may
give different batch sizes, e.g. in proportion to their shards), and every rank's sampler, the plan, B_exp = q·N
and the ledger use that q: no example is sampled above what the ledger charges. (Fixed-size shuffled batches
draw shard r at K·B_r/n_r: the largest of those is charged.) A rank whose loader is refused makes every rank
refuse (a rank that raised alone would leave the others waiting in the gather), and settings that differ
between ranks are refused.

**The same dataset, or shards?** Counting N as the sum is only right if the shards are disjoint. The common
mistake, every rank given the same global dataset with ``use_distributed_sampler=False``, would count N W times
and understate ε by a lot. So every rank hashes its dataset's length and a few examples at fixed positions, read
under fixed random seeds (so augmentations from the global generators agree) and read twice: a dataset that
draws from its own generator reads differently the second time, and its hash proves nothing. Ranks whose hashes
agree hold the same dataset; lengths or hashes that differ, different data. Where the hashes cannot tell (the
same length, a dataset read differently twice), the reading that cannot understate ε is taken: the same dataset
on every rank, counted once, with a warning that says how to declare real shards: ``dataset.dp_shard_id``, a
name of the shard (e.g. its file list) set on each rank's training dataset, which replaces the hash (the same
id: the same data; different ids: disjoint shards, the user's word). Every rank the same: one global dataset,
sharded by the DP sampler as in the default path. All different: shards. Some ranks the same and others not:
refused. The check cannot prove that different shards do not overlap (a shard that is a reordered copy of
another, or overlapping file lists): that stays the user's to ensure.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

from ..util.collectives import Collectives, gather_objects
from .repeats import check_no_repeated_examples
from .loader import check_sampler_describable, dataset_size, private_dataloader
from .samplers import poisson_sample_rate, shuffled_sample_rate

__all__ = ["TrainingData", "describe_training_data", "dataset_digest", "private_training_loader", "SHARD_ID"]

#: examples hashed per rank, at evenly spaced fixed positions (first and last included)
DIGEST_EXAMPLES = 8
#: the attribute of a rank's training dataset that names its shard, replacing the hash of its examples
SHARD_ID = "dp_shard_id"
_SETTINGS = ("accumulate_grad_batches", "poisson_sampling", "max_micro_batch_size")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingData:
    """How the training set is held, as every rank agreed.

    Attributes:
        dataset_size: N, examples in the whole training set (all ranks).
        shard_sizes: ``None``: one global dataset on every rank, sharded by the DP sampler; else the length of
            each rank's own shard, in rank order (their sum is N).
        batch_sizes: each rank's micro-batch B_r (its DataLoader's ``batch_size``), in rank order.
    """

    dataset_size: int
    shard_sizes: Optional[tuple[int, ...]] = None
    batch_sizes: tuple[int, ...] = (1,)

    def sample_rate(self, accumulate_grad_batches: int, poisson: bool) -> float:
        """The q every rank samples at and the ledger charges: K·ΣB_r/N with Poisson sampling
        (:func:`~lightning_dpzero.sampling.poisson_sample_rate`), the largest rate K·B_r/n_r at which a rank draws
        its examples with fixed-size batches (:func:`~lightning_dpzero.sampling.shuffled_sample_rate`).

        Raises:
            ValueError: q > 1 (Poisson; fixed-size batches larger than a shard are refused by their sampler).

        Example:
            >>> TrainingData(256, (64, 192), (2, 6)).sample_rate(1, poisson=True)  # (2 + 6) / 256
            0.03125
        """
        if poisson:
            return poisson_sample_rate(list(self.batch_sizes), len(self.batch_sizes), accumulate_grad_batches,
                                       self.dataset_size)
        return shuffled_sample_rate(self.batch_sizes, accumulate_grad_batches, self.dataset_size, self.shard_sizes)


class _RankView(NamedTuple):
    """What one rank's training loader is, as gathered from every rank."""

    batch_size: int
    length: int
    settings: tuple            #: the values of ``_SETTINGS``
    identity: Optional[tuple]  #: shards only: ("id", repr of ``dp_shard_id``) or ("digest", digest or None)
    error: Optional[str] = None


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


def _digest_pass(dataset: Any, n: int, positions: list[int]) -> str:
    h = hashlib.sha256(f"N{n}".encode())
    for i in positions:
        random.seed(i)
        np.random.seed(i)
        torch.manual_seed(i)
        _feed(h, dataset[i])
    return h.hexdigest()


def dataset_digest(dataset: Any, n: int) -> Optional[str]:
    """SHA-256 of ``n`` and of ``DIGEST_EXAMPLES`` examples at evenly spaced positions, each read with Python's,
    NumPy's and PyTorch's global random generators seeded alike (restored afterwards); read twice, and
    ``None`` where the two reads differ (a dataset drawing from a generator of its own: its hash would differ
    from rank to rank for the same data, so it identifies nothing).

    Example:
        >>> data = torch.utils.data.TensorDataset(torch.arange(10.0))
        >>> dataset_digest(data, 10) == dataset_digest(torch.utils.data.TensorDataset(torch.arange(10.0)), 10)
        True
        >>> dataset_digest(data, 10) == dataset_digest(torch.utils.data.TensorDataset(torch.arange(1.0, 11)), 10)
        False
    """
    positions = sorted({round(i * (n - 1) / max(DIGEST_EXAMPLES - 1, 1)) for i in range(DIGEST_EXAMPLES)})
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            first, second = [_digest_pass(dataset, n, positions) for _ in range(2)]
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
    return first if first == second else None


def _identity(dataset: Any, n: int) -> tuple:
    declared = getattr(dataset, SHARD_ID, None)
    if declared is not None:
        return ("id", repr(declared))
    try:
        return ("digest", dataset_digest(dataset, n))
    except Exception as err:  # noqa: BLE001 - e.g. a dataset that opens its files in the DataLoader's workers
        raise ValueError(
            f"use_distributed_sampler=False: reading {DIGEST_EXAMPLES} examples of this rank's training dataset, to "
            f"tell the same data on several ranks from per-rank shards, failed ({type(err).__name__}: {err}). "
            f"Declare what each rank holds instead: {_DECLARE}.") from err


def _local_view(dataloader: Any, settings: tuple, sharded: bool) -> _RankView:
    """This rank's part of the gather; raises what its loader is refused for."""
    check_sampler_describable(dataloader)
    n = dataset_size(dataloader, shard=sharded)
    batch_size = getattr(dataloader, "batch_size", None)
    if batch_size is None:
        raise ValueError("The training DataLoader must be built with batch_size=B (the per-device "
                         "micro-batch): the DP sampler replaces its sampler and needs B to set q.")
    check_no_repeated_examples(dataloader.dataset)
    return _RankView(int(batch_size), n, settings, _identity(dataloader.dataset, n) if sharded else None)


def describe_training_data(dataloader: Any, world_size: int, pre_sharded: bool, settings: tuple = (1, True, None)
                           ) -> TrainingData:
    """N, the sharding of the training set and every rank's B (see the module docstring), from one gather of
    every rank's view of its loader. Every rank calls it and gets the same answer, or every rank raises.

    Args:
        dataloader: this rank's training DataLoader.
        world_size: W.
        pre_sharded: ``use_distributed_sampler=False``: each rank's loader may hold its own shard.
        settings: this rank's (accumulate_grad_batches, poisson_sampling, max_micro_batch_size), which every
            rank must share.

    Raises:
        TypeError: a dataset without a length (an IterableDataset): N cannot be known.
        ValueError: a loader refused on any rank (no batch_size, a sampler the accountant cannot describe, an
            empty shard, repeated examples, ...: the rank raises its own error, the others name it); DP settings
            that differ between ranks; one global dataset of different lengths on different ranks; shards of which
            some ranks hold the same dataset (or cannot tell) and others not; a ``dp_shard_id`` on some ranks only.
    """
    sharded = pre_sharded and world_size > 1
    refused: Optional[BaseException] = None
    try:  # every rank reaches the gather, even one whose loader is refused (a rank that raised alone would hang)
        mine = _local_view(dataloader, tuple(settings), sharded)
    except Exception as err:  # noqa: BLE001 - re-raised below, after the gather
        mine, refused = _RankView(0, 0, tuple(settings), None, f"{type(err).__name__}: {err}"), err
    views = gather_objects(mine, world_size)
    if len(views) != world_size:  # no process group (a stand-in for W ranks): every rank taken to be this one
        views = [mine] * world_size
    if refused is not None:
        raise refused
    for rank, view in enumerate(views):
        if view.error is not None:
            raise ValueError(f"Rank {rank}'s training DataLoader was refused: {view.error}")
    _check_settings_agree(views)
    batch_sizes = tuple(v.batch_size for v in views)
    if not sharded:
        _check_one_length(views)
        return TrainingData(views[0].length, None, batch_sizes)
    return _shards_or_one(views, batch_sizes)


def _check_settings_agree(views: list[_RankView]) -> None:
    for rank, view in enumerate(views):
        diffs = [f"{name}={theirs!r} (rank 0: {ours!r})"
                 for name, ours, theirs in zip(_SETTINGS, views[0].settings, view.settings) if ours != theirs]
        if diffs:
            raise ValueError(
                f"Rank {rank} trains with {', '.join(diffs)}: every rank must run with the same DP settings, which "
                "set q and what each step charges (and every rank must draw the same number of micro-batches). "
                "Give every rank the same settings. Nothing was trained.")


def _check_one_length(views: list[_RankView]) -> None:
    lengths = [v.length for v in views]
    if len(set(lengths)) > 1:
        each = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
        raise ValueError(
            f"The ranks' training datasets differ in length ({each}), but with use_distributed_sampler=True every "
            "rank's DataLoader must hold the same global dataset, which the DP sampler shards over the ranks (rank "
            "r draws examples r, r+W, ...): N and q would differ from rank to rank. If each rank holds its own "
            "shard, say so with Trainer(use_distributed_sampler=False) or fabric.setup_dataloaders(..., "
            "use_distributed_sampler=False): N is then the sum of the shards, each sampled whole at one q. "
            "Nothing was trained.")


def _relation(a: _RankView, b: _RankView) -> str:
    """Whether two ranks hold the ``"same"`` dataset, ``"distinct"`` ones, or it is ``"unknown"``."""
    (kind, key_a), (_, key_b) = a.identity, b.identity
    if kind == "id":  # the user's word
        return "same" if key_a == key_b else "distinct"
    if a.length != b.length:
        return "distinct"
    if key_a is None or key_b is None:  # a dataset that reads differently twice: its hash proves nothing
        return "unknown"
    return "same" if key_a == key_b else "distinct"


_DECLARE = (f"set `{SHARD_ID}` on each rank's training dataset to a name of its data (e.g. its file list): "
            "the same name where ranks hold the same data, different names for disjoint shards")


def _shards_or_one(views: list[_RankView], batch_sizes: tuple[int, ...]) -> TrainingData:
    world, n = len(views), views[0].length
    declared = [r for r, v in enumerate(views) if v.identity[0] == "id"]
    if declared and len(declared) < world:
        raise ValueError(
            f"The training datasets of ranks {declared} declare their shard ({SHARD_ID}) and those of the other "
            f"ranks do not: {_DECLARE}, on every rank. Nothing was trained.")
    relation = {(i, j): _relation(views[i], views[j]) for i in range(world) for j in range(i + 1, world)}
    for (i, j), rel in relation.items():
        if rel == "same" and views[i].length != views[j].length:
            raise ValueError(f"The training datasets of ranks {i} and {j} declare the same {SHARD_ID} but hold "
                             f"{views[i].length} and {views[j].length} examples. {_DECLARE}. Nothing was trained.")
    found = set(relation.values())
    if found == {"distinct"}:
        return TrainingData(sum(v.length for v in views), tuple(v.length for v in views), batch_sizes)
    if "distinct" not in found:
        _say_one_dataset(views, "unknown" in found)
        return TrainingData(n, None, batch_sizes)
    same = sorted({tuple(r for r in range(world) if r == i or relation.get((min(i, r), max(i, r))) == "same")
                   for i in range(world)})
    same = [ranks for ranks in same if len(ranks) > 1]
    if same:
        groups = "; ".join("ranks " + ", ".join(map(str, ranks)) for ranks in same)
        raise ValueError(
            f"use_distributed_sampler=False: the training DataLoaders of {groups} hold the same dataset (the same "
            "length and the same examples), while other ranks hold other data. Each rank's DataLoader must hold its "
            "own, disjoint shard of the training set (N is the sum of the shards), or every rank the same global "
            "dataset (use_distributed_sampler=True then shards it). Nothing was trained.")
    i, j = next(pair for pair, rel in relation.items() if rel == "unknown")
    raise ValueError(
        f"use_distributed_sampler=False: the training datasets of ranks {i} and {j} have the same length ({n}) but "
        "read differently when read twice under the same seeds (a dataset that draws from a random generator of "
        "its own), so whether they hold the same data cannot be checked, while other ranks hold other data. "
        f"Declare each rank's shard: {_DECLARE}. Nothing was trained.")


def _say_one_dataset(views: list[_RankView], unproven: bool) -> None:
    world, n = len(views), views[0].length
    if not unproven:
        # the usual case (use_distributed_sampler=False set for validation sharding, as the example configs do):
        # correct as it is (the start line states N), so nothing to act on: a record of this module's logger,
        # which prints only where the user asked for INFO logs (Lightning's own logger prints INFO on the console)
        if getattr(rank_zero_only, "rank", 0) == 0:
            log.info(
                f"use_distributed_sampler=False, but every one of the {world} ranks' training DataLoaders holds the "
                f"same dataset ({n} examples: the same length and the same examples). It is treated as one global "
                f"dataset of N = {n} examples that the DP sampler shards over the ranks (not {world} shards of N = "
                f"{n * world}, which would understate ε). To train on per-rank shards, give each rank's DataLoader "
                "its own, disjoint part of the data.")
        return
    unread = [r for r, v in enumerate(views) if v.identity[1] is None]
    rank_zero_warn(
        f"use_distributed_sampler=False, and the {world} ranks' training datasets have the same length ({n}), but "
        f"those of ranks {unread} read differently when read twice under the same seeds (a dataset that draws from "
        "a random generator of its own, e.g. np.random.default_rng()), so whether the ranks hold the same data "
        f"cannot be checked. They are treated as one global dataset of N = {n} examples that the DP sampler shards "
        "over the ranks (each rank draws only the examples r, r+W, ... of its loader's dataset): the reading that "
        "cannot understate ε. If each rank holds its own, disjoint shard, declare it: "
        f"{_DECLARE}; N is then the sum of the shards and each shard is sampled whole.")


def _warn_unequal_rates(data: TrainingData, accumulate_grad_batches: int, q: float) -> None:
    """Fixed-size batches that draw the ranks' examples at unequal rates: the ledger charges the largest."""
    world = len(data.batch_sizes)
    shares = data.shard_sizes or (data.dataset_size / world,) * world
    rates = [accumulate_grad_batches * b / n for b, n in zip(data.batch_sizes, shares)]
    if min(rates) < q * (1 - 1e-9):
        over = f"shards of {list(data.shard_sizes)}" if data.shard_sizes else "equal shares"
        rank_zero_warn(
            f"poisson_sampling=False: the ranks draw their examples at unequal rates ("
            f"{', '.join(f'{r:.4g}' for r in rates)}: batch sizes {list(data.batch_sizes)} over {over}). Every "
            f"step is charged the largest, q = {q:.4g}, and divided by q·N = {q * data.dataset_size:.4g}, more than "
            "the examples it holds. Use poisson_sampling=True (every example sampled at one q), or batch sizes in "
            "proportion to the shards.")


def private_training_loader(dataloader: Any, collectives: Collectives, accumulate_grad_batches: int, *,
                            pre_sharded: bool, poisson: bool, seed: int, secure_mode: bool,
                            max_micro_batch_size: Optional[int], cyclic: Optional[dict] = None) -> Any:
    """The training loader over the same dataset with the distributed Poisson (``poisson``, else shuffled)
    sampler at the q all ranks agreed (:meth:`TrainingData.sample_rate`: ``q = B·W·K/N`` where the ranks' batch
    sizes B agree). ``pre_sharded`` (``use_distributed_sampler=False``): each rank's loader may hold its own
    shard, N is then the sum over ranks (:func:`describe_training_data`). ``max_micro_batch_size``: the bound of
    :class:`~lightning_dpzero.sampling.DistributedPoissonBatchSampler`. ``cyclic``: cyclic Poisson sampling over
    fixed parts (correlated noise; :func:`~lightning_dpzero.sampling.loader.private_dataloader`).

    Raises:
        TypeError: the dataset has no ``__len__`` (N is needed).
        ValueError: what :func:`describe_training_data` refuses, q > 1, or fixed-size batches larger than a
            rank's examples.
    """
    world, rank = collectives.world_size, collectives.global_rank
    data = describe_training_data(dataloader, world, pre_sharded,
                                  settings=(accumulate_grad_batches, poisson, max_micro_batch_size))
    q = data.sample_rate(accumulate_grad_batches, poisson)
    if not poisson:
        _warn_unequal_rates(data, accumulate_grad_batches, q)
    return private_dataloader(dataloader, q, world, rank, accumulate_grad_batches, seed=seed,
                              secure_mode=secure_mode, poisson=poisson, shard_sizes=data.shard_sizes,
                              max_micro_batch_size=max_micro_batch_size, batch_sizes=data.batch_sizes,
                              cyclic=cyclic)
