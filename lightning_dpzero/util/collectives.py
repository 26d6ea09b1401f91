"""What the DP pieces need from the processes of a run, and the gathers built on it.

:class:`Collectives` is the small interface the mechanism and the checkpoint protocol use to talk to the other
ranks. Every Trainer strategy (``lightning.pytorch``) satisfies it as it is, and
:class:`~lightning_dpzero.DPFabricStrategy` does by naming Fabric's ``all_reduce`` ``reduce``, so neither needs a
Trainer; :class:`SingleProcess` is the one for a loop in plain PyTorch (the audit).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch


@runtime_checkable
class Collectives(Protocol):
    """The ranks of a run: how many, which one this is, and the three collectives the DP pieces call."""

    @property
    def world_size(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def reduce(self, tensor: torch.Tensor, group: Optional[Any] = None, reduce_op: Optional[str] = "mean"
               ) -> torch.Tensor: ...

    def barrier(self, name: Optional[str] = None) -> None: ...


class SingleProcess:
    """:class:`Collectives` of a run in one process: every collective returns its input.

    Example:
        >>> SingleProcess().broadcast("run-id"), SingleProcess().world_size
        ('run-id', 1)
    """

    world_size, global_rank, is_global_zero = 1, 0, True

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce(self, tensor: torch.Tensor, group: Optional[Any] = None, reduce_op: Optional[str] = "mean"
               ) -> torch.Tensor:
        return tensor

    def barrier(self, name: Optional[str] = None) -> None:
        return None


def sum_over_ranks(collectives: Collectives, tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over every rank, in one all-reduce (in place where a process group is up).

    The per-step sums of the DP pieces (the finite-loss flags of every micro-batch, the clipping statistics and
    budget answer of every step) go through here rather than through ``collectives.reduce``: Lightning's and
    Fabric's ``reduce`` put a barrier before their all-reduce, a second round trip on every call (and on NCCL a
    device synchronisation), where the all-reduce alone already waits for every rank. Without an initialised
    process group of ``collectives.world_size`` ranks (one process, or a stand-in in tests) it is
    ``collectives.reduce(tensor, reduce_op="sum")``.

    Example:
        >>> sum_over_ranks(SingleProcess(), torch.tensor([1.0, 2.0]))
        tensor([1., 2.])
    """
    import torch.distributed as dist

    if (collectives.world_size > 1 and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() == collectives.world_size):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor
    return collectives.reduce(tensor, reduce_op="sum")


def gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` without an initialised process group of ``world_size``
    ranks: one process, or a stand-in in tests)."""
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()) \
            or dist.get_world_size() != world_size:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def gather_dicts(mine: dict, world_size: int) -> dict:
    """The union of every rank's dict, sorted by key."""
    merged: dict = {}
    for part in gather_objects(mine, world_size):
        merged.update(part)
    return dict(sorted(merged.items()))


def gather_lists(mine: list, world_size: int) -> list:
    """Every rank's list, concatenated in rank order."""
    return [item for part in gather_objects(mine, world_size) for item in part]
