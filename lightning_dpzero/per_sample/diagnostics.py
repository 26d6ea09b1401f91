"""Check, before a long private run, that a model's examples really are independent in its forward and loss.

Per-example clipping bounds each example's contribution only if example ``i``'s loss depends on example ``i``
alone and every layer sees the batch in its first dimension. The engine refuses what it can see (BatchNorm,
inputs without a batch dimension, parameters used outside their layer), but a hand-written operation across
the batch (``h - h.mean(0)``, an in-batch contrastive loss) or an input whose first dimension only happens
to equal the batch size is invisible to it. :func:`check_per_example` compares, on a few examples, the
engine's per-example gradient norms in one batched backward with the norms of a backward per example (each
example alone, a batch of one). They agree exactly (up to float rounding) when examples are independent.
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch
from torch import nn

from .engine import PerSampleEngine


class PerExampleMismatchError(AssertionError):
    """The batched per-example gradient norms differ from those of a backward per example."""


def check_per_example(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], rtol: float = 1e-3,
                      ) -> torch.Tensor:
    """Compare the engine's per-example gradient norms with a backward per example, on copies of ``model``.

    Args:
        model: the module as trained (in training mode); it is not modified (deep copies are used). Dropout
            modules are switched off in the copies; a forward calling ``F.dropout`` itself must get p = 0.
        inputs: ``(B, ...)`` a few examples (B ≥ 2), batch first.
        targets: ``(B, ...)`` their targets.
        loss_fn: ``loss_fn(model(inputs), targets)`` is the *mean* of the per-example losses (e.g.
            ``F.cross_entropy``).
        rtol: relative tolerance on each example's norm.

    Returns:
        The per-example gradient norms ``(B,)`` (fp32), which agreed.

    Raises:
        PerExampleMismatchError: naming the examples whose norms differ: the model mixes examples (or an
            input's first dimension is not the batch), so DP-SGD's bound would not hold.
        UnsupportedLayerError: from the engine, for what it refuses by itself.
    """
    b = inputs.shape[0]
    if b < 2:
        raise ValueError("check_per_example needs at least 2 examples.")
    batched, single = _copy_without_dropout(model), _copy_without_dropout(model)
    engine = PerSampleEngine(batched, max_grad_norm=math.inf).attach()
    with engine.micro_batch(batch_size=b):
        loss_fn(batched(inputs), targets).backward()
    engine_norms = engine.last_norms.float()
    engine.detach()
    params = [p for p in single.parameters() if p.requires_grad]
    alone = []
    for i in range(b):
        single.zero_grad(set_to_none=True)
        loss_fn(single(inputs[i:i + 1]), targets[i:i + 1]).backward()
        alone.append(math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in params if p.grad is not None)))
    alone_t = torch.tensor(alone)
    bad = [i for i in range(b) if not math.isclose(float(engine_norms[i]), alone[i], rel_tol=rtol, abs_tol=1e-7)]
    if bad:
        rows = ", ".join(f"example {i}: {float(engine_norms[i]):.6g} in the batch vs {alone[i]:.6g} alone"
                         for i in bad[:5])
        raise PerExampleMismatchError(
            f"Per-example gradient norms in a batch of {b} differ from a backward per example ({rows}). The "
            "forward or the loss mixes examples (e.g. h - h.mean(0), an in-batch contrastive loss, statistics "
            "over the batch), or a layer input's first dimension is not the batch; per-example clipping would "
            "not bound each example's contribution. Make each example's loss depend on that example only.")
    return alone_t


def _copy_without_dropout(model: nn.Module) -> nn.Module:
    m = copy.deepcopy(model).train()
    for mod in m.modules():
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            mod.p = 0.0
    return m
