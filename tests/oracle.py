"""Reference per-example clipping built from ``torch.func`` (vmap of grad), used by the oracle tests."""

from __future__ import annotations

import math

import torch
from torch.func import functional_call, grad, vmap

from lightning_dpzero.per_sample.clipping import clip_coefficients


def per_example_grads(model, loss_fn, inputs, targets):
    """{name: (B, *shape)} gradients of each example's own loss, in float64."""
    params = {k: v.detach().double() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    model = model.double()

    def one(p, x, y):
        out = functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    x = inputs.double() if inputs.is_floating_point() else inputs
    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, targets)
    model.float()
    return g


def clipped_sum(model, grads, max_grad_norm, clipping="all-layer", clipping_fn="abadi", gamma=0.01, groups=None):
    """Σ_i clip(g_i) per parameter name: all-layer, layer-wise (one group per module) or explicit ``groups``
    (lists of names), each group clipped to C/sqrt(K)."""
    names = list(grads)
    if groups is None and clipping == "all-layer":
        groups = [names]
    elif groups is None:
        by_mod: dict[str, list[str]] = {}
        for n in names:
            by_mod.setdefault(n.rsplit(".", 1)[0] if "." in n else "", []).append(n)
        groups = list(by_mod.values())
    thr = [max_grad_norm / math.sqrt(len(groups))] * len(groups)
    out = {}
    for grp, c in zip(groups, thr):
        sq = sum(grads[n].flatten(1).pow(2).sum(1) for n in grp)
        coef = clip_coefficients(sq.sqrt(), c, clipping_fn, gamma).double()
        for n in grp:
            out[n] = (grads[n] * coef.view(-1, *[1] * (grads[n].dim() - 1))).sum(0)
    return out


def per_example_grads_loop(model, loss_fn, inputs, targets):
    """{name: (B, *shape)} gradients of each example's own loss in float64, by one backward per example on a
    batch of one (for models ``torch.func`` cannot transform, e.g. HuggingFace's): trainable parameters only;
    ``model`` is not modified (a float64 copy is used)."""
    import copy

    m = copy.deepcopy(model).double()
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    params = [p for p in m.parameters() if p.requires_grad]  # tied parameters once, in named_parameters order
    out = {n: [] for n in names}
    for i in range(inputs.shape[0]):
        x = inputs[i:i + 1]
        x = x.double() if x.is_floating_point() else x
        grads = torch.autograd.grad(loss_fn(m(x), targets[i:i + 1]), params, allow_unused=True)
        for n, p, g in zip(names, params, grads):
            out[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(v) for n, v in out.items()}
