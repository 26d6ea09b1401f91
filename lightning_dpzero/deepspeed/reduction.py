"""How the clipped sums of a clipping group that spans layers reach DeepSpeed's one reduction per optimizer step
(docs/design.md, *Where each piece runs*: backward).

Such a group (all-layer, group-wise) is complete only at the end of the backward pass, after DeepSpeed's reduce
hooks ran, so on ZeRO 1-3 its clipped sums are written into ``p.grad`` inside ``coalesce_grad_reduction()``, whose
exit reduces what the parameters hold. One block is one optimizer step: on ZeRO-1 and -2 a block's flush overwrites
what an earlier block of the same accumulation window reduced (measured with DeepSpeed 0.19.8: with one block per
micro-batch only the last micro-batch reached the update; on ZeRO-3 the blocks happened to accumulate, but DeepSpeed
documents that blocks must not span a window, so every stage uses the buffer below). Lightning runs DeepSpeed's
``step()`` after every micro-batch, and ``step()`` inside a block raises, so one block cannot span the window
either. Hence, with ``accumulate_grad_batches = K > 1``: the K - 1 micro-batches before the boundary hold their
clipped sums in the engine's local fp32 buffer (their backward hands DeepSpeed zeros, reduced as any accumulation
step's), and the boundary micro-batch's backward runs inside the block and writes its sums with the held ones.

With two-pass clipping nothing is deferred: the first backward pass (norms only) runs with DeepSpeed's output hooks
suspended (:func:`output_hooks_suspended`), and DeepSpeed's own backward returns the clipped sums through autograd.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


@contextlib.contextmanager
def deferred_writes_reduced(per_sample, deepspeed_engine, zero_stage: int, accumulate_grad_batches: int
                            ) -> Iterator[None]:
    """Around one micro-batch's backward: nothing to do for layer-wise groups (returned through autograd) or on
    stage 0 (``p.grad`` accumulates and DeepSpeed reduces it at the boundary); otherwise see the module."""
    if not per_sample.needs_deferred_writes or zero_stage < 1:
        yield
        return
    boundary = bool(deepspeed_engine.is_gradient_accumulation_boundary())
    if accumulate_grad_batches > 1:
        per_sample.accumulate_window(boundary)
    if not boundary:
        yield
        return
    # ZeRO-1/2's hooks do nothing inside the block and its flush reduces only what p.grad holds then: a deferred
    # site hands them no zeros, and each p.grad appears with its clipped sum (one kernel per parameter fewer);
    # ZeRO-3's leaf modules still take zeros
    zeros, per_sample.deferred_zeros = per_sample.deferred_zeros, per_sample.deferred_zeros and zero_stage >= 3
    try:
        with deepspeed_engine.coalesce_grad_reduction():
            yield
            per_sample.window.flush()  # whatever the backward did not write (e.g. a group of sites that never ran)
    finally:
        per_sample.deferred_zeros = zeros


def output_hook_managers(outputs: Any) -> list:
    """The backward-hook managers DeepSpeed's forward attached to its outputs (``outputs``: a tensor, or a
    tuple, list or dict of them; each manager is kept on the first tensor it hooked)."""
    found: list = []
    stack = [outputs]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.extend(m for m in getattr(item, "_backward_hook_managers", ()) if m not in found)
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


@contextlib.contextmanager
def output_hooks_suspended(managers: list) -> Iterator[None]:
    """DeepSpeed's hooks on its forward's outputs removed for the block, then put back: they start its backward
    (the ZeRO optimizer's prologue once per forward, the 1/gradient_accumulation_steps on the output gradients,
    and for a plain ``tensor.backward()`` the reduction at its end), which the first pass of two-pass clipping
    must not start, as DeepSpeed's own backward follows it (docs/design.md, *Two-pass clipping*)."""
    removed = []
    for manager in managers:
        for handle in manager.hook_handles:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                removed.append((hooks, handle.id, hooks.pop(handle.id)))
    try:
        yield
    finally:
        for hooks, key, fn in removed:
            hooks[key] = fn
