"""``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.InstanceNorm1d/2d/3d`` and ``nn.RMSNorm`` (affine parameters).

Their parameters are small (p = normalised size or channels), so the per-example gradients
``Σ_positions x̂ ⊙ g`` (weight) and ``Σ_positions g`` (bias), shape ``(B, p)`` fp32, are cheap to form
exactly; x̂ is the input normalised without the affine map, in fp32. LayerNorm and GroupNorm/InstanceNorm
compute the input gradient with PyTorch's own backward kernel from one normalisation of the saved input,
whose x̂ the norms reuse (fp32 inputs; other dtypes recompute x̂ in fp32), and the ``(B, p)`` per-example
gradients of the norm are kept for the site's clipped sum: one normalisation per backward instead of three.

All of these normalise each example with its own statistics, so per-example gradients exist. InstanceNorm
with ``track_running_stats=True`` is refused: its running mean and variance are averages over the training
examples, updated without noise and used by the released model in eval mode, so the trained model would not
be differentially private (the same reason BatchNorm is refused, besides its mixing of examples).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerRule, UnsupportedLayerError
from .linear import kept_sites
from .maths import param_shape
from .paths import fits_deferred


class _AffineNormRule(LayerRule):
    #: ``norm_sq`` accepts ``keep=True``; the (B, p) per-example gradients are kept for the site's clipped sum
    #: (also for a group completed later: they are small beside the site's own records)
    keeps_per_example = True
    _xhat: Optional[tuple] = None  # (x, x̂ fp32) from ``grad_input`` of the site in progress

    def _normalized(self, module, x):
        raise NotImplementedError

    def _per_example(self, module, x, g):
        """(weight, bias) per-example gradients, each ``(B, p)`` fp32."""
        raise NotImplementedError

    def _take_xhat(self, x):
        """x̂ that ``grad_input`` computed for this very input (fp32 inputs only), else None."""
        kept, self._xhat = self._xhat, None
        return kept[1] if kept is not None and kept[0] is x else None

    def norm_sq(self, module, x, g, mask, keep: bool = False):
        per = self._per_example(module, x, g)
        if keep or fits_deferred(x, g, sum(t.shape[1] for t in per)):  # (B, p): small beside x and g
            kept_sites(self).put(x, g, per)
        return [t.pow(2).sum(1) if m else None for t, m in zip(per, mask)]

    def per_example(self, module, x, g, mask):
        per = self._per_example(module, x, g)
        params = self.params(module)
        return [t.view(t.shape[0], *param_shape(p)) if m else None for t, p, m in zip(per, params, mask)]

    def clipped_grads(self, module, x, g, coef, mask):
        per = kept_sites(self).take(x, g)
        if per is None:
            per = self._per_example(module, x, g)
        params = self.params(module)
        c = coef.view(1, -1)
        return [c.mm(t).view(param_shape(p)).to(g.dtype) if m else None for t, p, m in zip(per, params, mask)]


def _same_dtype(x, g, params) -> bool:
    return x.dtype == g.dtype and all(p is None or p.dtype == x.dtype for p in params)


class LayerNormRule(_AffineNormRule):
    module_types = (nn.LayerNorm,)

    def forward(self, module, x, weight=None, bias=None):
        return F.layer_norm(x, module.normalized_shape, weight, bias, module.eps)

    def grad_input(self, module, x, params, g):
        """PyTorch's own LayerNorm backward from one normalisation, whose x̂ the norms then reuse (fp32)."""
        if not _same_dtype(x, g, params):
            return super().grad_input(module, x, params, g)
        shape = list(module.normalized_shape)
        xh, mean, rstd = torch.native_layer_norm(x, shape, None, None, module.eps)
        w, b = (list(params) + [None, None])[:2]
        gx = torch.ops.aten.native_layer_norm_backward(g, x, shape, mean, rstd, w, b, [True, False, False])[0]
        self._xhat = (x, xh) if x.dtype == torch.float32 else None
        return gx

    def _per_example(self, module, x, g):
        n = math.prod(module.normalized_shape)
        xh = self._take_xhat(x)
        if xh is None:
            xh = F.layer_norm(x.float(), module.normalized_shape, None, None, module.eps)
        B = x.shape[0]
        T = x.numel() // max(B * n, 1)
        gf = g.float().reshape(B, T, n)
        return (xh.reshape(B, T, n) * gf).sum(1), gf.sum(1)


class GroupNormRule(_AffineNormRule):
    module_types = (nn.GroupNorm,)

    def forward(self, module, x, weight=None, bias=None):
        return F.group_norm(x, module.num_groups, weight, bias, module.eps)

    def grad_input(self, module, x, params, g):
        """PyTorch's own GroupNorm backward from one normalisation, whose x̂ the norms then reuse (fp32)."""
        if not _same_dtype(x, g, params) or x.dim() < 2 or x.shape[0] == 0:
            return super().grad_input(module, x, params, g)
        x, g = x.contiguous(), g.contiguous()
        N, C = x.shape[0], x.shape[1]
        HxW = x.numel() // (N * C)
        G = self._groups(module, x)
        xh, mean, rstd = torch.native_group_norm(x, None, None, N, C, HxW, G, module.eps)
        w = params[0] if params else None
        gx = torch.ops.aten.native_group_norm_backward(g, x, mean, rstd, w, N, C, HxW, G, [True, False, False])[0]
        self._xhat = (x, xh) if x.dtype == torch.float32 else None
        return gx

    def _groups(self, module, x) -> int:
        return module.num_groups

    def _per_example(self, module, x, g):
        xh = self._take_xhat(x)
        if xh is None:
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

    def _groups(self, module, x) -> int:
        return x.shape[1]

    def _per_example(self, module, x, g):
        xh = self._take_xhat(x)
        if xh is None:
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
