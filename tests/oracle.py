"""Reference per-example clipping built from ``torch.func`` (vmap of grad), used by the oracle tests."""

from __future__ import annotations

import math

import torch
from torch.func import functional_call, grad, vmap

from lightning_dpzero.per_sample.clipping import clip_coefficients


def per_example_grads(model, loss_fn, inputs, targets, dtype=torch.float64):
    """{name: (B, *shape)} gradients of each example's own loss, in float64 (or ``dtype``; the model is left in
    float32)."""
    params = {k: v.detach().to(dtype) for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    model = model.to(dtype)

    def one(p, x, y):
        out = functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    x = inputs.to(dtype) if inputs.is_floating_point() else inputs
    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, targets.to(dtype) if targets.is_floating_point() else targets)
    model.float()
    return g


def layer_of(name: str) -> str:
    """The layer a parameter name belongs to: its module's path, or for a parametrization's parameter
    (``conv.parametrizations.weight.original0``) the parametrized layer's (``conv``)."""
    if name.startswith("parametrizations.") or ".parametrizations." in name:
        return name.split("parametrizations.")[0].removesuffix(".")
    return name.rsplit(".", 1)[0] if "." in name else ""


def clipped_sum(model, grads, max_grad_norm, clipping="all-layer", clipping_fn="abadi", gamma=0.01, groups=None):
    """Σ_i clip(g_i) per parameter name: all-layer, layer-wise (one group per layer, :func:`layer_of`) or
    explicit ``groups`` (lists of names), each group clipped to C/sqrt(K)."""
    names = list(grads)
    if groups is None and clipping == "all-layer":
        groups = [names]
    elif groups is None:
        groups = layer_groups(names, merge=owned_children(model))
    thr = [max_grad_norm / math.sqrt(len(groups))] * len(groups)
    out = {}
    for grp, c in zip(groups, thr):
        sq = sum(grads[n].reshape(len(grads[n]), math.prod(grads[n].shape[1:])).pow(2).sum(1)  # scalar ones too
                 for n in grp)
        coef = clip_coefficients(sq.sqrt(), c, clipping_fn, gamma).double()
        for n in grp:
            out[n] = (grads[n] * coef.view(-1, *[1] * (grads[n].dim() - 1))).sum(0)
    return out



def loop_per_example_grads(model, loss_of, B, dtype=torch.float64, alone=True):
    """{name: (B, *shape)} gradients of each example's own loss by one backward per example, for layers that
    ``torch.func.vmap`` cannot batch (GRU, packed sequences, bags given by offsets).

    ``loss_of(model, idx, dtype)`` runs the model on the examples ``idx`` (positions in the batch) together
    and returns their losses ``(len(idx),)``. ``alone=True``: a ``dtype`` copy of the model runs on each
    example by itself, so batching in the layer under test cannot leak into the reference; ``alone=False``:
    one forward of the whole batch and a backward of each example's loss through it (randomness drawn once
    for the batch: dropout masks under a fixed seed)."""
    import copy

    m = copy.deepcopy(model).to(dtype)
    named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    per = {n: [] for n, _ in named}
    batch = None if alone or not B else loss_of(m, list(range(B)), dtype)
    for i in range(B):
        loss = loss_of(m, [i], dtype)[0] if alone else batch[i]
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True, retain_graph=not alone)
        for (n, p), g in zip(named, grads):
            per[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(per[n]) if B else torch.zeros(0, *p.shape, dtype=dtype) for n, p in named}


def unit_means(grads: dict, units) -> dict:
    """Per-example gradients ``{name: (B, *shape)}`` → each privacy unit's mean ``{name: (U, *shape)}``;
    ``units``: row i's unit (any hashables, in order of first appearance)."""
    ids = {u: k for k, u in enumerate(dict.fromkeys(units))}
    index = torch.tensor([ids[u] for u in units])
    counts = torch.bincount(index, minlength=len(ids))
    return {n: torch.zeros(len(ids), *g.shape[1:], dtype=g.dtype).index_add_(0, index, g)
            / counts.to(g.dtype).view(-1, *[1] * (g.dim() - 1)) for n, g in grads.items()}


def owned_children(model) -> dict[str, str]:
    """Child modules whose parameters their parent's rule owns, mapped to the parent's path: a
    ``nn.MultiheadAttention`` reads ``out_proj``'s parameters without calling it, so the engine's layer (and
    layer-wise group) is the whole attention (``per_sample/attention.py``)."""
    return {f"{n}.out_proj" if n else "out_proj": n for n, m in model.named_modules()
            if isinstance(m, torch.nn.MultiheadAttention)}


def layer_groups(names, merge=None):
    """Layer-wise clipping groups of parameter names: one per layer (:func:`layer_of`; ``merge`` maps a path to
    its owner's)."""
    by: dict[str, list[str]] = {}
    for n in names:
        mod = layer_of(n)
        by.setdefault((merge or {}).get(mod, mod), []).append(n)
    return list(by.values())


def clipping_mode(clip) -> str:
    """The engine's ``clipping_mode`` for an oracle case ``clip``: its ``"mode"`` (two-pass or book-keeping) where
    a group spans layers, book-keeping for layer-wise (which refuses two-pass)."""
    return clip.get("mode", "book-keeping") if clip["clipping"] != "layer-wise" else "book-keeping"


def backward(engine, loss) -> None:
    """``loss.backward()`` through ``engine``: with two-pass clipping, the engine's norms pass first."""
    engine.norms_pass(loss)
    loss.backward()


def check_engine_against_loop(model, loss_of, B, clip, context=None, alone=True, seed=None):
    """The engine's Σ_i clip(g_i) for the mean of ``loss_of(model, all examples)`` against
    :func:`loop_per_example_grads` (float64 with ``alone``, else the model's dtype with the batch forward),
    under ``context`` (e.g. a forced path). ``seed``: the RNG seed set before each forward (dropout masks).
    ``clip``: clipping, clipping_fn, C. Returns the engine (detached)."""
    import contextlib

    from lightning_dpzero.per_sample import PerSampleEngine

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = layer_groups(names) if clip["clipping"] == "layer-wise" else None
    if seed is not None:
        torch.manual_seed(seed)
    grads = loop_per_example_grads(model, loss_of, B, torch.float64 if alone else torch.float32, alone)
    ref = clipped_sum(model, {n: g.double() for n, g in grads.items()}, clip["C"], clip["clipping"],
                      clip["clipping_fn"], groups=groups)
    model.zero_grad(set_to_none=True)
    engine = PerSampleEngine(model, max_grad_norm=clip["C"], clipping=clip["clipping"],
                             clipping_fn=clip["clipping_fn"], clipping_mode=clipping_mode(clip)).attach()
    try:
        if seed is not None:
            torch.manual_seed(seed)
        with context or contextlib.nullcontext(), engine.micro_batch(batch_size=B):
            losses = loss_of(model, list(range(B)), torch.float32)
            backward(engine, torch.nan_to_num(losses.mean()))  # B = 0: the mean over no examples is NaN
    finally:
        engine.detach()
    tol = 1e-4 * (1.0 + max((float(r.abs().max()) for r in ref.values() if r.numel()), default=0.0))
    for n, p in model.named_parameters():
        if p.requires_grad:
            got = p.grad.double() if p.grad is not None else torch.zeros_like(ref[n])
            torch.testing.assert_close(got, ref[n], rtol=1e-3, atol=tol, msg=lambda m: f"{n}: {m}")
    return engine


def per_example_grads_loop(model, loss_fn, inputs, targets):
    """{name: (B, *shape)} gradients of each example's own loss in float64, by one backward per example on a
    batch of one (for models ``torch.func`` cannot transform, e.g. HuggingFace's): trainable parameters only;
    ``model`` is not modified (a float64 copy is used)."""
    import copy

    m = copy.deepcopy(model).double()
    for mod in m.modules():  # HF's grouped_mm experts have no float64 kernel; "eager" computes the same function
        if getattr(getattr(mod, "config", None), "_experts_implementation", None) not in (None, "eager"):
            mod.config._experts_implementation = "eager"
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
