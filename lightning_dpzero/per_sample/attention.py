"""``nn.MultiheadAttention`` with ``batch_first=True``: self- and cross-attention, every parameter.

Parameters (E = embed_dim, H heads, d_h = E/H): the in-projection ``in_proj_weight`` (3E, E), or with
kdim/vdim ≠ E ``q_proj_weight`` (E, E), ``k_proj_weight`` (E, kdim), ``v_proj_weight`` (E, vdim);
``in_proj_bias`` (3E,); ``bias_k``, ``bias_v`` (1, 1, E) with ``add_bias_kv``; and ``out_proj.weight`` (E, E),
``out_proj.bias`` (E,). PyTorch's attention reads ``out_proj``'s parameters without calling ``out_proj``, so
this rule owns them (``owned_children``): the whole attention is one layer, one group in layer-wise clipping,
and ``out_proj`` is never covered twice.

Each projection is a Linear over rows of one example: ``q = query W_qᵀ + b_q`` (L rows), ``k``, ``v`` (S rows),
``out = c W_oᵀ + b_o`` with ``c`` (B, L, E) the attention context. Per-example gradients are therefore the
Linear ones for the pairs (query, ∂q), (key, ∂k), (value, ∂v), (c, ∂out): norms by ``rows_norm_sq`` on the
ghost or instantiate path ``paths.rows_path`` picks (Li et al. 2021; never kept, so never reuse), clipped
sums by ``weighted_rows_grad`` (no B×E×E tensor); ``bias_k``/
``bias_v`` get the gradient of their appended key/value row. ∂q, ∂k, ∂v come from one recompute of the
attention core (projections excluded) under autograd in backward; the forward keeps the inputs and, with
dropout, its mask. The attention weights may be used in the loss: their gradient joins the recompute.

The layer is called ``mha(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
average_attn_weights=True, is_causal=False)`` (``LayerRule.multi_input``); masks are constants (bool: True
= not attended; float: added to the scores); ``is_causal`` is a hint, the given ``attn_mask`` is applied,
except where PyTorch itself applies a causal mask instead (no key padding mask, ``need_weights=False``).
Refused: ``batch_first=False``, unbatched inputs, masks that require grad.

Under ZeRO-3, ``out_proj``'s parameters are gathered only if the attention is a leaf module
(``deepspeed.utils.set_z3_leaf_modules(model, [nn.MultiheadAttention])``), as for PyTorch's own forward.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Inputs, LayerRule, UnsupportedLayerError
from .maths import param_shape, per_example_sq, rows_norm_sq, rows_per_example, weighted_rows_grad, weighted_sum
from .paths import rows_path
from .registry import register_rule

_SIG = inspect.signature(nn.MultiheadAttention.forward)
_NAMES = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k", "bias_v",
          "out_proj.weight", "out_proj.bias")


def _additive(m, dtype):
    """A bool mask (True = masked) as -inf/0, a float mask as it is."""
    if m is None:
        return None
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(m, float("-inf"))
    return m.to(dtype)


@register_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(LayerRule):
    param_names = _NAMES
    owned_children = ("out_proj",)
    multi_input = True

    def params(self, module):
        return [functools.reduce(lambda m, a: getattr(m, a, None), n.split("."), module) for n in _NAMES]

    def check(self, module, name):
        if not module.batch_first:
            raise UnsupportedLayerError(
                f"MultiheadAttention '{name}' has batch_first=False; per-example clipping needs the batch "
                "dimension first in every layer. Fix: construct it with batch_first=True and pass (B, L, E) tensors.")

    # ------------------------------------------------------------------ the call
    def bind(self, module, x, args, kwargs):
        a = _SIG.bind(module, x, *args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        q, k, v = a["query"], a["key"], a["value"]
        for n, t in (("query", q), ("key", k), ("value", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != q.shape[0]:
                raise UnsupportedLayerError(
                    f"MultiheadAttention: {n} has shape {tuple(getattr(t, 'shape', ()))}; per-example clipping "
                    "needs batched (B, L, E) query, key and value with the same batch size B first.")
        kpm, am = a["key_padding_mask"], a["attn_mask"]
        if any(m is not None and m.requires_grad for m in (kpm, am)):
            raise UnsupportedLayerError("MultiheadAttention: attention masks that require grad are not supported; "
                                        "detach them.")
        if a["is_causal"] and am is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention).")
        w = module.out_proj.weight
        if w.numel() == 0 and hasattr(w, "ds_shape"):
            raise UnsupportedLayerError(
                "MultiheadAttention: out_proj's parameters were not gathered by ZeRO-3 (the attention reads them "
                "without calling out_proj). Fix: deepspeed.utils.set_z3_leaf_modules(model, [nn.MultiheadAttention]).")
        B, L, S, H = q.shape[0], q.shape[1], k.shape[1], module.num_heads
        extra = int(module.bias_k is not None) + int(module.add_zero_attn)
        mask = None
        if a["is_causal"] and kpm is None and not a["need_weights"]:
            # PyTorch then drops attn_mask and lets SDPA mask causally over all keys, appended ones included
            am, mask = None, _additive(torch.ones(L, S + extra, dtype=torch.bool, device=q.device).triu(1), q.dtype)
            mask, extra = mask.reshape(1, 1, L, S + extra), 0
        if am is not None:
            am = _additive(am, q.dtype)
            mask = am.reshape(1, 1, L, S) if am.dim() == 2 else am.reshape(B, H, L, S)
        if kpm is not None:
            kpm = _additive(kpm, q.dtype).reshape(B, 1, 1, S)
            mask = kpm if mask is None else mask + kpm
        if mask is not None and extra:
            mask = F.pad(mask, (0, extra))  # the appended bias/zero keys are never masked
        opts = {"mask": mask, "need_weights": bool(a["need_weights"]), "average": bool(a["average_attn_weights"]),
                "dropout": module.dropout if module.training else 0.0}
        return (q, k, v), opts

    def _in_proj(self, module, params):
        W, Wq, Wk, Wv, b = params[:5]
        if W is not None:
            Wq, Wk, Wv = W.chunk(3)
        bq, bk, bv = b.chunk(3) if b is not None else (None, None, None)
        return (Wq, Wk, Wv), (bq, bk, bv)

    def _project(self, module, query, key, value, params):
        """q (B, L, E); k, v (B, S[+1], E) with the ``bias_k``/``bias_v`` row appended."""
        (Wq, Wk, Wv), (bq, bk, bv) = self._in_proj(module, params)
        q, k, v = F.linear(query, Wq, bq), F.linear(key, Wk, bk), F.linear(value, Wv, bv)
        if params[5] is not None:
            B, E = k.shape[0], module.embed_dim
            k = torch.cat([k, params[5].to(k.dtype).reshape(1, 1, E).expand(B, 1, E)], 1)
            v = torch.cat([v, params[6].to(v.dtype).reshape(1, 1, E).expand(B, 1, E)], 1)
        return q, k, v

    def _attend(self, module, q, k, v, o):
        """Context ``c`` (B, L, E) and the returned attention weights (or ``None``)."""
        B, L, E = q.shape
        H = module.num_heads
        hd = E // H
        if module.add_zero_attn:
            z = q.new_zeros(B, 1, E)
            k, v = torch.cat([k, z], 1), torch.cat([v, z], 1)
        S = k.shape[1]
        qh = q.reshape(B, L, H, hd).transpose(1, 2)
        kh, vh = (t.reshape(B, S, H, hd).transpose(1, 2) for t in (k, v))
        s = torch.matmul(qh * math.sqrt(1.0 / hd), kh.transpose(-2, -1))  # (B, H, L, S)
        if o["mask"] is not None:
            s = s + o["mask"]
        p = torch.softmax(s, -1)
        if o.get("keep") is not None:
            p = p * o["keep"]
        c = torch.matmul(p, vh).transpose(1, 2).reshape(B, L, E)
        w = (p.mean(1) if o["average"] else p) if o["need_weights"] else None
        return c, w

    def forward(self, module, inputs, *params):
        query, key, value = inputs
        o = inputs.options
        q, k, v = self._project(module, query, key, value, params)
        if o["dropout"] > 0 and o.get("keep") is None:  # kept for the recompute in backward
            shape = (q.shape[0], module.num_heads, q.shape[1], k.shape[1] + int(module.add_zero_attn))
            o["keep"] = F.dropout(q.new_ones(shape), o["dropout"])
        c, w = self._attend(module, q, k, v, o)
        return F.linear(c, params[7], params[8]), w

    def backward_multi(self, module, inputs, params, grads, needs_input_grad):
        query, key, value = inputs
        g_out, g_w = grads
        if g_out is None:
            g_out = query.new_zeros(query.shape[0], query.shape[1], module.embed_dim)
        q, k, v = (t.detach() for t in self._project(module, query, key, value, params))
        with torch.enable_grad():
            q, k, v = (t.requires_grad_(True) for t in (q, k, v))
            c, w = self._attend(module, q, k, v, inputs.options)
            outs, gs = [c], [g_out.matmul(params[7].to(g_out.dtype))]
            if g_w is not None:
                outs.append(w)
                gs.append(g_w)
            gq, gk, gv = torch.autograd.grad(outs, (q, k, v), gs, allow_unused=True)
        gq, gk, gv = (torch.zeros_like(t) if gt is None else gt for t, gt in ((q, gq), (k, gk), (v, gv)))
        S = key.shape[1]
        (Wq, Wk, Wv), _ = self._in_proj(module, params)
        gin = [gt.matmul(W.to(gt.dtype)) if need else None
               for gt, W, need in ((gq, Wq, needs_input_grad[0]), (gk[:, :S], Wk, needs_input_grad[1]),
                                   (gv[:, :S], Wv, needs_input_grad[2]))]
        return gin, Inputs((query, key, value, c.detach())), (gq, gk, gv, g_out)

    # ------------------------------------------------------------------ per-example gradients
    @staticmethod
    def _pieces(x, g):
        """Per parameter slot: ("w", [(rows in, rows grad)]), ("b", [rows grad]) or ("v", (B, E) grads)."""
        query, key, value, c = x
        gq, gk, gv, go = g
        S = key.shape[1]
        wq, wk, wv = (query, gq), (key, gk[:, :S]), (value, gv[:, :S])
        return [("w", [wq, wk, wv]), ("w", [wq]), ("w", [wk]), ("w", [wv]), ("b", [gq, gk[:, :S], gv[:, :S]]),
                ("v", gk[:, S] if gk.shape[1] > S else None), ("v", gv[:, S] if gv.shape[1] > S else None),
                ("w", [(c, go)]), ("b", [go])]

    def _slots(self, site, mask, fn):
        """``fn(kind, t, param)`` for each parameter slot that ``mask`` selects, ``None`` elsewhere."""
        return [fn(kind, t, p) if m else None
                for (kind, t), m, p in zip(self._pieces(site.x, site.g), mask, self.params(site.module))]

    def norm_sq(self, site, mask):
        grams = site.hook.engine.input_grams  # self-attention: query, key and value are one input

        def sq(kind, t, p):
            if kind == "w":
                return sum(rows_norm_sq(a, gg, rows_path(a, gg), grams) for a, gg in t)
            if kind == "b":
                return sum(per_example_sq(gg.float().sum(1)) for gg in t)
            return per_example_sq(t)
        return self._slots(site, mask, sq)

    def per_example(self, site, mask):
        def per(kind, t, p):
            if kind == "w":
                pe = torch.cat([rows_per_example(a, gg) for a, gg in t], 1)
            elif kind == "b":
                pe = torch.cat([gg.float().sum(1) for gg in t], 1)
            else:
                pe = t.float()
            return pe.reshape(pe.shape[0], *param_shape(p))
        return self._slots(site, mask, per)

    def clipped_grads(self, site, coef, mask):
        def clipped(kind, t, p):
            if kind == "w":
                s = torch.cat([weighted_rows_grad(a, gg, coef) for a, gg in t], 0)
            elif kind == "b":
                s = torch.cat([weighted_sum(gg.float().sum(1), coef) for gg in t], 0)
            else:
                s = weighted_sum(t.float(), coef)
            return s.to(site.g[0].dtype).reshape(param_shape(p))
        return self._slots(site, mask, clipped)
