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

    def norm_sq(self, module, x, g, mask):
        per = self._per_example(module, x, g)
        return [t.pow(2).sum(1) if m else None for t, m in zip(per, mask)]

    def per_example(self, module, x, g, mask):
        per = self._per_example(module, x, g)
        params = self.params(module)
        return [t.view(t.shape[0], *param_shape(p)) if m else None for t, p, m in zip(per, params, mask)]

    def clipped_grads(self, module, x, g, coef, mask):
        per = self._per_example(module, x, g)
        params = self.params(module)
        c = coef.view(-1, 1)
        return [(t * c).sum(0).view(param_shape(p)).to(g.dtype) if m else None for t, p, m in zip(per, params, mask)]


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
        T = x.numel() // max(B * n, 1)
        gf = g.float().reshape(B, T, n)
        return (xh.reshape(B, T, n) * gf).sum(1), gf.sum(1)


class GroupNormRule(_AffineNormRule):
    module_types = (nn.GroupNorm,)

    def forward(self, module, x, weight=None, bias=None):
        return F.group_norm(x, module.num_groups, weight, bias, module.eps)

    def _per_example(self, module, x, g):
        xh = F.group_norm(x.float(), module.num_groups, None, None, module.eps)
        B, C = x.shape[0], x.shape[1]
        gf = g.float().flatten(2) if g.dim() > 2 else g.float().unsqueeze(2)
        return (xh.reshape(gf.shape) * gf).sum(2), gf.sum(2)
