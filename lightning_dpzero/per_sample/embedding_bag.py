"""``nn.EmbeddingBag``: modes sum, mean and max; 2-D indices ``(B, N)`` or 1-D indices with ``offsets``
(``include_last_offset`` too); ``padding_idx``; ``per_sample_weights`` (mode sum), which may require grad.

Example i is bag i: the batch size is the number of bags (``B`` rows of 2-D indices, else ``len(offsets)``,
minus one with ``include_last_offset``), not ``input.shape[0]``. Bag i's output is
``Σ_{j ∈ bag i} w_j E[idx_j]`` with ``w_j`` its per-sample weight (sum; 1 without), ``1/n_i`` (mean, ``n_i``
the bag's entries other than ``padding_idx``), and 0 for an entry equal to ``padding_idx``; so with output
gradient ``g_i`` its weight gradient has one row per distinct index ``v`` in the bag, ``s_{i,v} g_i`` with
``s_{i,v} = Σ_{j: idx_j = v} w_j``, and ``‖G_i‖² = ‖g_i‖² Σ_v s_{i,v}²`` (``O(entries + B·D)``, no
``(B, V, D)`` tensor). In mode max each coordinate k of ``g_i`` goes to the row of the index that attained
the maximum (PyTorch's own ``max_indices``), so ``‖G_i‖² = ‖g_i‖²`` for a bag with an entry, 0 for an empty
one (whose output is zero). The clipped sum scatters ``c_i w_j g_i`` (max: ``c_i g_{i,k}``) to the rows.

Refused as for ``nn.Embedding``: ``max_norm`` (renormalises the weight in place in the forward),
``scale_grad_by_freq`` (scales by counts over the whole batch, mixing examples), ``sparse=True``; and
nested-tensor inputs.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from .base import Inputs, LayerRule, UnsupportedLayerError
from .embedding import EmbeddingRule
from .registry import register_rule

_SIG = inspect.signature(nn.EmbeddingBag.forward)
_MODES = {"sum": 0, "mean": 1, "max": 2}


def _call(module, x, extra):
    """``(input, offsets, per_sample_weights)`` of one call ``module(x, *args, **kwargs)``."""
    a = _SIG.bind(module, x, *extra[0], **extra[1])
    a.apply_defaults()
    return a.arguments["input"], a.arguments["offsets"], a.arguments["per_sample_weights"]


def _flat(module, idx, offsets, psw):
    """PyTorch's own normalisation (``F.embedding_bag``): 1-D indices, offsets, ``include_last_offset``."""
    if idx.dim() == 2:
        step = max(idx.shape[1], 1)
        offsets = torch.arange(0, idx.numel(), step, dtype=idx.dtype, device=idx.device)[:idx.shape[0]]
        return idx.reshape(-1), offsets, False, (psw.reshape(-1) if psw is not None else None)
    return idx, offsets, module.include_last_offset, psw


@register_rule(nn.EmbeddingBag)
class EmbeddingBagRule(LayerRule):
    """``site.x`` holds ``(nonempty (B,), indices (N,), bag of each index (N,), weights (N,), max_indices)``,
    ``site.g`` the output gradient ``(B, D)``."""

    param_names = ("weight",)
    multi_input = True

    check = EmbeddingRule.check

    def batch_size(self, module, x, extra=((), {})):
        idx, offsets, _ = _call(module, x, extra)
        if not isinstance(idx, torch.Tensor) or idx.dim() not in (1, 2) or idx.is_nested \
                or (idx.dim() == 1 and offsets is None):
            raise UnsupportedLayerError(
                f"EmbeddingBag received indices of shape {tuple(getattr(idx, 'shape', ()))}; per-example clipping "
                "needs (B, N) indices (one bag per row) or 1-D indices with offsets (one bag per offset), "
                "not a nested tensor.")
        if idx.dim() == 2:
            return idx.shape[0], 0
        return offsets.numel() - int(module.include_last_offset), None

    def layout_inputs(self, module, args, kwargs):
        idx, offsets, psw = _call(module, args[0], (args[1:], kwargs))
        if idx.dim() == 2:
            return [t for t in (idx, psw) if t is not None]
        ends = offsets.tolist()[1:] if module.include_last_offset else [*offsets.tolist()[1:], idx.numel()]
        bags = [(int(a), int(b)) for a, b in zip(offsets.tolist(), ends)]  # example i is bag i
        return [[t[a:b] for a, b in bags] for t in (idx, psw) if t is not None]

    def bind(self, module, x, args, kwargs):
        return _call(module, x, (args, kwargs)), {}

    def forward(self, module, inputs, weight):
        idx, offsets, psw = inputs
        return F.embedding_bag(idx, weight, offsets, module.max_norm, module.norm_type, module.scale_grad_by_freq,
                               module.mode, module.sparse, psw, module.include_last_offset, module.padding_idx)

    def backward_multi(self, module, inputs, params, grads, needs_input_grad):
        idx, offsets, psw = inputs
        weight, g = params[0], grads[0]
        gin = [None, None, None]
        if needs_input_grad[2]:  # d psw_j = <g_{bag j}, E[idx_j]> (0 at padding_idx): PyTorch's own backward
            with torch.enable_grad():
                w_ = psw.detach().requires_grad_(True)
                out = self.forward(module, Inputs((idx, offsets, w_)), weight.detach())
                (gin[2],) = torch.autograd.grad(out, w_, g)
        flat, offs, last, pw = _flat(module, idx, offsets, psw)
        B = offs.numel() - int(last)
        end = int(offs[-1]) if last and offs.numel() else flat.numel()
        bounds = torch.cat([offs[:B], offs.new_tensor([end])])
        bag = torch.repeat_interleave(torch.arange(B, device=flat.device), bounds.diff())
        flat = flat[:end]
        pad = module.padding_idx
        keep = (flat != pad) if pad is not None else torch.ones_like(flat, dtype=torch.bool)
        count = torch.zeros(B, device=flat.device).index_add_(0, bag, keep.float())
        if module.mode == "sum":
            w = keep.float() * (pw[:end].detach().float() if pw is not None else 1.0)
        else:
            w = keep.float() / count.clamp_min(1)[bag]
        maxidx = None
        if module.mode == "max":  # the row that attained each coordinate's maximum, as PyTorch's backward uses
            maxidx = torch.embedding_bag(weight.detach(), flat, offs, False, 2, False, None, last,
                                         module.padding_idx)[3]
        return gin, Inputs((count > 0, flat, bag, w, maxidx)), g

    # ------------------------------------------------------------------ per-example gradients
    @staticmethod
    def _segments(site):
        """Per (bag, distinct index) key ``i·V + v``: keys ``(U,)`` and ``s_{i,v}`` ``(U,)`` fp32."""
        _, flat, bag, w, _ = site.x
        V = site.module.num_embeddings
        uniq, inv = torch.unique(bag * V + flat, return_inverse=True)
        return uniq, torch.zeros(uniq.numel(), device=w.device).index_add_(0, inv, w)

    def norm_sq(self, site, mask):
        nonempty = site.x[0]
        gsq = site.g.float().pow(2).sum(1)
        if site.module.mode == "max":
            return [gsq * nonempty.float()]
        uniq, s = self._segments(site)
        V = site.module.num_embeddings
        per_bag = torch.zeros_like(gsq).index_add_(0, torch.div(uniq, V, rounding_mode="floor"), s.pow(2))
        return [gsq * per_bag]

    def _max_rows(self, site, coef=None):
        """Mode max: flat positions ``v·D + k`` of each bag's coordinates and their values ``c_i g_{i,k}``."""
        nonempty, _, _, _, maxidx = site.x
        g = site.g.float() * nonempty.float().unsqueeze(1)
        if coef is not None:
            g = g * coef.float().unsqueeze(1)
        D = g.shape[1]
        return maxidx * D + torch.arange(D, device=g.device), g

    def per_example(self, site, mask):
        g, V = site.g.float(), site.module.num_embeddings
        B, D = g.shape
        if site.module.mode == "max":
            pos, val = self._max_rows(site)
            pos = pos + (torch.arange(B, device=g.device) * V * D).unsqueeze(1)
            return [torch.zeros(B * V * D, device=g.device).index_add_(0, pos.reshape(-1), val.reshape(-1))
                    .view(B, V, D)]
        uniq, s = self._segments(site)
        rows = s.unsqueeze(1) * g[torch.div(uniq, V, rounding_mode="floor")]
        return [torch.zeros(B * V, D, device=g.device).index_copy_(0, uniq, rows).view(B, V, D)]

    def clipped_grads(self, site, coef, mask):
        g, V = site.g, site.module.num_embeddings
        D = g.shape[1]
        if site.module.mode == "max":
            pos, val = self._max_rows(site, coef)
            out = torch.zeros(V * D, dtype=g.dtype, device=g.device)
            return [out.index_add_(0, pos.reshape(-1), val.reshape(-1).to(g.dtype)).view(V, D)]
        _, flat, bag, w, _ = site.x
        rows = (w * coef.float()[bag]).unsqueeze(1).to(g.dtype) * g[bag]
        return [torch.zeros(V, D, dtype=g.dtype, device=g.device).index_add_(0, flat, rows)]
