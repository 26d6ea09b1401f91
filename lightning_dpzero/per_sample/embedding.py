"""``nn.Embedding`` with repeated tokens and ``padding_idx``.

Example i's weight gradient has one row per *distinct* token it contains: the sum of the output gradients
at that token's positions. For the norms and the clipped sum rows are segment-summed over (example,
token) keys, so the cost is ``O(B·T·p)`` and no ``(B, V, p)`` tensor is built; only ``per_example`` (an
embedding shared by several call sites, e.g. tied to the output head) instantiates the ``(B, V, p)``
per-example gradients, whose norm needs the sum over the sites.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from .base import LayerRule, UnsupportedLayerError
from .registry import register_rule


@register_rule(nn.Embedding)
class EmbeddingRule(LayerRule):
    rows_independent = True
    param_names = ("weight",)
    broadcast_batch = True  # position ids (1, T) in a larger micro-batch: one copy, one gradient per example
    min_input_dim = 2  # indices (B, T, ...): a (T,) index tensor is refused (its length could equal B by chance)

    def check(self, module, name):
        for attr, bad in (("max_norm", None), ("sparse", False), ("scale_grad_by_freq", False)):
            if getattr(module, attr) != bad:
                raise UnsupportedLayerError(
                    f"{type(module).__name__} '{name}' sets {attr}={getattr(module, attr)!r}, which per-example clipping does "
                    f"not support. Fix: construct it with {attr}={bad!r}.")

    def forward(self, module, x, weight):
        return F.embedding(x, weight, module.padding_idx)

    def _rows(self, module, x, g):
        B, p = x.shape[0], g.shape[-1]
        idx = x.flatten(1) if x.dim() > 1 else x.unsqueeze(1)
        gg = g.reshape(B, idx.shape[1], p)  # explicit sizes: an empty batch (B = 0) is valid
        if module.padding_idx is not None:
            gg = gg * (idx != module.padding_idx).unsqueeze(-1).to(gg.dtype)
        return idx, gg

    def _segments(self, module, x, g):
        """Output gradients summed per (example, token) key: keys ``(U,)`` = i·V + token, rows ``(U, p)``."""
        idx, gg = self._rows(module, x, g)
        B, p, V = idx.shape[0], gg.shape[-1], module.num_embeddings
        key = (torch.arange(B, device=idx.device).unsqueeze(1) * V + idx).reshape(-1)
        uniq, inv = torch.unique(key, return_inverse=True)
        rows = torch.zeros(uniq.numel(), p, dtype=torch.float32, device=gg.device)
        return uniq, rows.index_add_(0, inv, gg.reshape(-1, p).float())

    def norm_sq(self, site, mask):
        module, x = site.module, site.x
        uniq, rows = self._segments(module, x, site.g)
        out = torch.zeros(x.shape[0], dtype=torch.float32, device=rows.device)
        V = module.num_embeddings
        return [out.index_add_(0, torch.div(uniq, V, rounding_mode="floor"), rows.pow(2).sum(1))]

    def per_example(self, site, mask):
        module, x = site.module, site.x
        uniq, rows = self._segments(module, x, site.g)
        B, V = x.shape[0], module.num_embeddings
        out = torch.zeros(B * V, rows.shape[1], dtype=torch.float32, device=rows.device)
        return [out.index_copy_(0, uniq, rows).view(B, V, rows.shape[1])]

    def clipped_grads(self, site, coef, mask):
        module, g = site.module, site.g
        idx, gg = self._rows(module, site.x, g)
        gw = (gg * coef.to(gg.dtype).view(-1, 1, 1)).reshape(-1, gg.shape[-1])
        out = torch.zeros(module.num_embeddings, gg.shape[-1], dtype=g.dtype, device=g.device)
        return [out.index_add_(0, idx.reshape(-1), gw)]
