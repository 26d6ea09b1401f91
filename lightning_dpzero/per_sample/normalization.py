"""``nn.LayerNorm`` and ``nn.GroupNorm`` (elementwise affine): per-example gradients are instantiated.

Their parameters are small (p = normalised size or channels), so the per-example gradients
``Σ_positions x̂ ⊙ g`` (weight) and ``Σ_positions g`` (bias), shape ``(B, p)``, are cheap to form exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerRule, param_shape


class _AffineNormRule(LayerRule):
    def _normalized(self, module, x):
        raise NotImplementedError

    def _per_example(self, module, x, g):
        """(weight, bias) per-example gradients, each ``(B, p)`` fp32."""
        raise NotImplementedError

    def norm_sq(self, module, x, g, trainable):
        gw, gb = self._per_example(module, x, g)
        out = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        if trainable[0]:
            out += gw.pow(2).sum(1)
        if trainable[1]:
            out += gb.pow(2).sum(1)
        return out

    def clipped_grads(self, module, x, g, coef, trainable):
        gw, gb = self._per_example(module, x, g)
        c = coef.view(-1, 1)
        w = (gw * c).sum(0).view(param_shape(module.weight)).to(g.dtype) if trainable[0] else None
        b = (gb * c).sum(0).view(param_shape(module.bias)).to(g.dtype) if trainable[1] else None
        return [w, b]


class LayerNormRule(_AffineNormRule):
    module_types = (nn.LayerNorm,)

    def forward(self, module, x, weight=None, bias=None):
        return F.layer_norm(x, module.normalized_shape, weight, bias, module.eps)

    def _per_example(self, module, x, g):
        n = 1
        for s in module.normalized_shape:
            n *= s
        xh = F.layer_norm(x.float(), module.normalized_shape, None, None, module.eps)
        B = x.shape[0]
        gf = g.float().reshape(B, -1, n)
        return (xh.reshape(B, -1, n) * gf).sum(1), gf.sum(1)


class GroupNormRule(_AffineNormRule):
    module_types = (nn.GroupNorm,)

    def forward(self, module, x, weight=None, bias=None):
        return F.group_norm(x, module.num_groups, weight, bias, module.eps)

    def _per_example(self, module, x, g):
        xh = F.group_norm(x.float(), module.num_groups, None, None, module.eps)
        B, C = x.shape[0], x.shape[1]
        gf = g.float().reshape(B, C, -1)
        return (xh.reshape(B, C, -1) * gf).sum(2), gf.sum(2)
