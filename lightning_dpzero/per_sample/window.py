"""Deferred writes of clipped sums into ``p.grad``, and the local buffer of an accumulation window
(docs/design.md, *The per-example engine* and *Where each piece runs*: backward).

A clipping group that spans layers (all-layer, group-wise) is complete only at the end of the backward pass,
after DeepSpeed's per-parameter reduce hooks have run; its clipped sums are written into ``p.grad`` inside
DeepSpeed's ``coalesce_grad_reduction()``, whose exit reduces them once. That block is one optimizer step: its
flush overwrites what an earlier block of the same accumulation window reduced on ZeRO-1 and -2, so with
``accumulate_grad_batches = K > 1`` only the window's last micro-batch (the accumulation boundary) may write.
The clipped sums of the K - 1 micro-batches before it are *held* here, in one fp32 buffer per trainable
parameter of this rank (the size of the whole local gradient), and added to ``p.grad`` with the boundary
micro-batch's own, inside its block: the window's gradient then reaches DeepSpeed in its one reduction.
"""

from __future__ import annotations

from typing import Iterable

import torch


def write_grad(p: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """``p.grad += grad`` (or ``p.grad = grad``), in ``p``'s gradient dtype."""
    if p.grad is None:
        p.grad = grad.to(p.dtype)
    else:
        p.grad.add_(grad.to(p.grad.dtype).view_as(p.grad))


class WindowBuffer:
    """The clipped sums of an accumulation window's micro-batches before its boundary.

    ``hold=True`` (set by :meth:`PerSampleEngine.accumulate_window` before a micro-batch's backward): every
    clipped sum of the backward is added to the buffer (fp32), nothing is written. ``hold=False``: each sum is
    written into ``p.grad`` together with what the buffer holds for ``p``, and :meth:`flush` writes and frees
    whatever is left. Memory: one fp32 tensor of each trainable parameter's full shape while a window is open.
    """

    def __init__(self) -> None:
        self.hold = False
        self._held: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._held)

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds now."""
        return sum(t.numel() * t.element_size() for _, t in self._held.values())

    def grad_into(self, p: torch.nn.Parameter, dtype: torch.dtype, numel: int):
        """``p.grad`` where a clipped sum in ``dtype`` of ``numel`` values may be added into it in place (what
        :meth:`write` would do with it: nothing held, not holding), else ``None``."""
        grad = p.grad
        if (self.hold or id(p) in self._held or grad is None or grad.dtype != dtype or grad.numel() != numel
                or not grad.is_contiguous()):
            return None
        return grad

    def write(self, sums: Iterable[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        """Hold or write one backward's clipped sums ``(p, Σ_i coef_i g_i)``."""
        for p, grad in sums:
            held = self._held.get(id(p))
            if self.hold:
                if held is None:
                    self._held[id(p)] = (p, grad.detach().to(torch.float32, copy=True))
                else:
                    held[1].add_(grad.detach().to(torch.float32).view_as(held[1]))
            else:
                if held is not None:
                    del self._held[id(p)]
                    grad = held[1].add_(grad.detach().to(torch.float32).view_as(held[1]))
                write_grad(p, grad)

    def flush(self) -> None:
        """Write and free everything held (the boundary micro-batch: inside DeepSpeed's coalesced block)."""
        held, self._held = self._held, {}
        for p, grad in held.values():
            write_grad(p, grad)

    def clear(self) -> None:
        """Drop what is held (training stopped inside a window: nothing of it may reach a later step)."""
        self._held = {}
