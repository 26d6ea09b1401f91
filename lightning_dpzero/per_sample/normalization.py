"""``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.InstanceNorm1d/2d/3d`` and ``nn.RMSNorm`` (affine parameters).

Their parameters are small (p = normalised size or channels), so the per-example gradients
``Σ_positions x̂ ⊙ g`` (weight) and ``Σ_positions g`` (bias), shape ``(B, p)`` fp32, are cheap to form
exactly; x̂ is the input normalised without the affine map, recomputed in fp32 from the saved input.

All of these normalise each example with its own statistics, so per-example gradients exist. InstanceNorm
with ``track_running_stats=True`` is refused: its running mean and variance are averages over the training
examples, updated without noise and used by the released model in eval mode, so the trained model would not
be differentially private (the same reason BatchNorm is refused, besides its mixing of examples).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerRule, UnsupportedLayerError, param_shape


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
        gf = g.float().flatten(2) if g.dim() > 2 else g.float().unsqueeze(2)
        return (xh.reshape(gf.shape) * gf).sum(2), gf.sum(2)


class InstanceNormRule(GroupNormRule):
    """InstanceNorm1d/2d/3d with ``affine=True``: GroupNorm with one channel per group, per-example stats."""

    module_types = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
    forward_methods = ("forward", "_apply_instance_norm")

    def check(self, module, name):
        if module.track_running_stats:
            raise UnsupportedLayerError(
                f"{type(module).__name__} '{name}' has track_running_stats=True: its running statistics are "
                "averages of the training examples, kept without noise and used in eval mode, so the released "
                "model would not be differentially private. Fix: construct it with track_running_stats=False "
                "(the default).")

    def forward(self, module, x, weight=None, bias=None):
        n = module._get_no_batch_dim() - 1  # spatial dimensions
        if x.dim() != n + 2:
            raise UnsupportedLayerError(
                f"{type(module).__name__} received an input of shape {tuple(x.shape)}; per-example clipping "
                f"needs a batched input (B, C, {', '.join('*' * n)}), batch first.")
        # = F.instance_norm (per-example, per-channel statistics), which fails on an empty batch when affine
        return F.group_norm(x, x.shape[1], weight, bias, module.eps)

    def _per_example(self, module, x, g):
        xh = F.instance_norm(x.float(), eps=module.eps)
        gf = g.float().flatten(2)
        return (xh.flatten(2) * gf).sum(2), gf.sum(2)


class RMSNormRule(_AffineNormRule):
    """``nn.RMSNorm`` (weight only): per-example gradient ``Σ_positions x̂ ⊙ g``, x̂ = x / rms(x)."""

    module_types = (nn.RMSNorm,)
    param_names = ("weight",)

    @staticmethod
    def _eps(module, x):
        return module.eps if module.eps is not None else torch.finfo(x.dtype).eps  # as F.rms_norm, in x's dtype

    def forward(self, module, x, weight=None):
        return F.rms_norm(x, module.normalized_shape, weight, self._eps(module, x))

    def _per_example(self, module, x, g):
        n = math.prod(module.normalized_shape)
        B = x.shape[0]
        T = x.numel() // max(B * n, 1)
        xh = F.rms_norm(x.float(), module.normalized_shape, None, self._eps(module, x))
        return ((xh.reshape(B, T, n) * g.float().reshape(B, T, n)).sum(1),)
