"""``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.InstanceNorm1d/2d/3d`` and ``nn.RMSNorm`` (affine parameters).

Their parameters are small (p = normalised size or channels), so the per-example gradients
``Σ_positions x̂ ⊙ g`` (weight) and ``Σ_positions g`` (bias), shape ``(B, p)`` fp32, are cheap to form
exactly; x̂ is the input normalised without the affine map, in fp32. How the backward avoids normalising
the input again and again (fp32; other dtypes recompute x̂ in fp32 and the input gradient under autograd or
with PyTorch's kernel):

* LayerNorm: PyTorch's own backward kernel from one normalisation of the saved input, whose x̂ the norms
  reuse;
* GroupNorm / InstanceNorm: the forward's mean and reciprocal std (saved through
  :meth:`~.base.LayerRule.forward_saving`) and one call of PyTorch's backward kernel with the batch folded
  into the channels, which gives the per-example gradients too: no normalisation in the backward;
* RMSNorm: the input gradient in closed form (:func:`rms_backward`) from one normalisation, whose x̂ the
  norms reuse (PyTorch has no RMSNorm backward kernel on the CPU).

The ``(B, p)`` per-example gradients are kept for the site's clipped sum (on the call's ``Site``; whether to
keep is :func:`.paths.may_keep`'s).

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
from .maths import add_weighted_rows, joined, joint_rows, param_shape, rows_sq, split_sum, weighted_sum
from .paths import may_keep
from .registry import register_rule


class _AffineNormRule(LayerRule):
    """The (B, p) per-example gradients are kept on the site for its clipped sum, also for a group completed
    later (they are small beside the site's own records)."""

    def _per_example(self, site):
        """(weight, bias) per-example gradients, each ``(B, p)`` fp32."""
        raise NotImplementedError

    def _native(self, site, params) -> Optional[tuple]:
        """``(input gradient, the input it was computed from, x̂)`` from one normalisation (PyTorch's own backward
        kernel, or a closed form), or ``None`` where the layer has neither or the call does not suit it."""
        return None

    def grad_input(self, site, params):
        """The input gradient from one normalisation (:meth:`_native`), whose x̂ the norms then reuse (fp32
        inputs), where input, gradient and parameters share a dtype; otherwise the forward recomputed under
        autograd."""
        native = self._native(site, params) if _same_dtype(site.x, site.g, params) else None
        if native is None:
            return super().grad_input(site, params)
        gx, x, xh = native
        if x.dtype == torch.float32:
            site.kept["xhat"] = (x, xh)
        return gx

    @staticmethod
    def _take_xhat(site) -> Optional[torch.Tensor]:
        """x̂ that ``grad_input`` computed for this very input (not for a contiguous copy of it), else None."""
        kept = site.kept.pop("xhat", None)
        return kept[1] if kept is not None and kept[0] is site.x else None

    def norm_sq(self, site, mask):
        per = self._per_example(site)
        if may_keep(site, sum(t.shape[1] for t in per)):
            site.kept["per_example"] = per
            site.path = "reuse"
        else:
            site.path = "instantiate"
        if len(per) == 2 and all(mask) and len(site.hook.groups) == 1:  # one group: the sum for the weight, in one op
            both = joined(per)  # side by side in one buffer (LayerNorm) or apart
            return [rows_sq(both) if both is not None else rows_sq(per[1], rows_sq(per[0])), None]
        return [rows_sq(t) if m else None for t, m in zip(per, mask)]

    def per_example(self, site, mask):
        per = self._per_example(site)
        params = self.params(site.module)
        return [t.view(t.shape[0], *param_shape(p)) if m else None for t, p, m in zip(per, params, mask)]

    def releases_rows(self, site):
        return "per_example" in site.kept

    scales_sums = True

    def clipped_grads(self, site, coef, mask, alpha=1.0):
        per = site.kept.pop("per_example", None)
        if per is None:
            per = self._per_example(site)
        params = self.params(site.module)
        both = joined(per) if all(mask) else None
        if both is not None:  # one product for weight and bias
            sums = split_sum(weighted_sum(both, coef, alpha), per)
            return [t.view(param_shape(p)).to(site.dtype) for t, p in zip(sums, params)]
        c = (coef if alpha == 1.0 else coef * alpha).view(1, -1)
        return [c.mm(t).view(param_shape(p)).to(site.dtype) if m else None for t, p, m in zip(per, params, mask)]


    def add_clipped_grads(self, site, coef, mask, into):
        """The ``(B, p)`` per-example gradients' sums added into ``p.grad`` in place (one ``addmm_`` each) where
        they were kept and the gradient is fp32; the rest through :meth:`clipped_grads`."""
        per = site.kept.get("per_example")
        if per is None:
            return self.clipped_grads(site, coef, mask)
        rest = [m and not add_weighted_rows(t, rows, coef) for m, t, rows in zip(mask, into, per)]
        if not any(rest):
            site.kept.pop("per_example")
            return [None] * len(mask)
        return self.clipped_grads(site, coef, rest)


def _same_dtype(x, g, params) -> bool:
    return x.dtype == g.dtype and all(p is None or p.dtype == x.dtype for p in params)


@register_rule(nn.LayerNorm)
class LayerNormRule(_AffineNormRule):
    """``nn.LayerNorm`` (elementwise affine weight and bias over ``normalized_shape``)."""

    rows_independent = True

    def forward(self, module, x, weight=None, bias=None):
        return F.layer_norm(x, module.normalized_shape, weight, bias, module.eps)

    def _native(self, site, params):
        module, x, g = site.module, site.x, site.g
        shape = list(module.normalized_shape)
        xh, mean, rstd = torch.native_layer_norm(x, shape, None, None, module.eps)
        w, b = (list(params) + [None, None])[:2]
        gx = torch.ops.aten.native_layer_norm_backward(g, x, shape, mean, rstd, w, b, [True, False, False])[0]
        return gx, x, xh

    def _per_example(self, site):
        module, x, g = site.module, site.x, site.g
        n = math.prod(module.normalized_shape)
        xh = self._take_xhat(site)
        if xh is None:
            xh = F.layer_norm(x.float(), module.normalized_shape, None, None, module.eps)
        B = x.shape[0]
        T = x.numel() // max(B * n, 1)
        gf = g.float().reshape(B, T, n)
        w, b = joint_rows(B, [n, n], gf)  # side by side: one squared-norm op and one weighted sum for both
        return torch.sum(xh.reshape(B, T, n) * gf, 1, out=w), torch.sum(gf, 1, out=b)


@register_rule(nn.GroupNorm)
class GroupNormRule(_AffineNormRule):
    """``nn.GroupNorm`` (per-channel affine weight and bias).

    In fp32 outside autocast, the forward keeps its per-(example, group) mean and reciprocal std, and one
    call of PyTorch's backward kernel gives the input gradient *and* the per-example gradients: the batch
    folded into the channels (one example of ``B·C`` channels in ``B·G`` groups, the weight tiled B times)
    normalises every group with the same statistics, and that kernel's weight and bias gradients, ``(B·C,)``,
    are then the per-example ``Σ_positions x̂ ⊙ g`` and ``Σ_positions g``. So the backward costs what the
    non-DP one does (no second normalisation, no per-example sums in Python)."""

    def _validate(self, module, x) -> None:
        """Raise for an input the layer's per-example clipping refuses (InstanceNorm: unbatched)."""

    def forward(self, module, x, weight=None, bias=None):
        self._validate(module, x)
        return F.group_norm(x, self._groups(module, x), weight, bias, module.eps)

    def forward_saving(self, module, x, weight=None, bias=None):
        if not _folds(x, (weight, bias)):
            return self.forward(module, x, weight, bias), ()
        self._validate(module, x)
        N, C = x.shape[0], x.shape[1]
        out, mean, rstd = torch.native_group_norm(x.contiguous(), weight, bias, N, C, x.numel() // (N * C),
                                                  self._groups(module, x), module.eps)
        return out, (mean, rstd)

    def _groups(self, module, x) -> int:
        return module.num_groups

    def _stats(self, site):
        """The forward's (mean, rstd), ``(B, G)``, else recomputed from the saved input."""
        kept = site.kept.get("forward")  # kept: a second call (per-example gradients not kept) reads it again
        if kept is not None:
            return kept
        x = site.x.contiguous()
        N, C = x.shape[0], x.shape[1]
        return torch.native_group_norm(x, None, None, N, C, x.numel() // (N * C), self._groups(site.module, x),
                                       site.module.eps)[1:]

    def _folded_backward(self, site, weight, input_grad: bool):
        """``(input gradient or None, (B, C) weight and (B, C) bias per-example gradients)`` from one call of
        PyTorch's GroupNorm backward kernel with the batch folded into the channels."""
        x, g = site.x.contiguous(), site.g.contiguous()
        B, C = x.shape[0], x.shape[1]
        mean, rstd = self._stats(site)
        # the weight scales only the input gradient; the kernel sizes its weight gradient by it, so it is given
        w = weight.repeat(B) if weight is not None else x.new_ones(B * C)
        gx, gw, gb = torch.ops.aten.native_group_norm_backward(
            g.view(1, B * C, -1), x.view(1, B * C, -1), mean.reshape(1, -1), rstd.reshape(1, -1), w, 1, B * C,
            x.numel() // (B * C), mean.numel(), [input_grad, True, True])
        return (gx.view(x.shape) if input_grad else None), (gw.view(B, C), gb.view(B, C))

    def grad_input(self, site, params):
        weight = params[0] if params else None
        if not _folds(site.x, params, site.g):
            return super().grad_input(site, params)
        gx, site.kept["folded"] = self._folded_backward(site, weight, input_grad=True)
        return gx

    def _native(self, site, params):
        module, x, g = site.module, site.x, site.g
        if x.dim() < 2 or x.shape[0] == 0:
            return None
        x, g = x.contiguous(), g.contiguous()
        N, C = x.shape[0], x.shape[1]
        HxW = x.numel() // (N * C)
        G = self._groups(module, x)
        xh, mean, rstd = torch.native_group_norm(x, None, None, N, C, HxW, G, module.eps)
        w = params[0] if params else None
        gx = torch.ops.aten.native_group_norm_backward(g, x, mean, rstd, w, N, C, HxW, G, [True, False, False])[0]
        return gx, x, xh

    def _per_example(self, site):
        folded = site.kept.pop("folded", None)
        if folded is not None:
            return folded
        module, x, g = site.module, site.x, site.g
        if _folds(x, (), g):
            return self._folded_backward(site, None, input_grad=False)[1]
        xh = self._take_xhat(site)
        if xh is None:
            xh = F.group_norm(x.float(), self._groups(module, x), None, None, module.eps)
        gf = g.float().flatten(2) if g.dim() > 2 else g.float().unsqueeze(2)
        return (xh.reshape(gf.shape) * gf).sum(2), gf.sum(2)


def _folds(x, params, g=None) -> bool:
    """The folded-batch kernels apply: a batched fp32 input (with fp32 parameters and output gradient),
    outside autocast (whose policy for ``group_norm`` a direct kernel call would bypass)."""
    return x.dim() >= 2 and x.shape[0] > 0 and _fp32_eager(x, g, *params)


@register_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
class InstanceNormRule(GroupNormRule):
    """InstanceNorm1d/2d/3d with ``affine=True``: GroupNorm with one channel per group, per-example stats."""

    forward_methods = ("forward", "_apply_instance_norm")

    def check(self, module, name):
        if module.track_running_stats:
            raise UnsupportedLayerError(
                f"{type(module).__name__} '{name}' has track_running_stats=True: its running statistics are "
                "averages of the training examples, kept without noise and used in eval mode, so the released "
                "model would not be differentially private. Fix: construct it with track_running_stats=False "
                "(the default).")

    def _validate(self, module, x):
        n = module._get_no_batch_dim() - 1  # spatial dimensions
        if x.dim() != n + 2:
            raise UnsupportedLayerError(
                f"{type(module).__name__} received an input of shape {tuple(x.shape)}; per-example clipping "
                f"needs a batched input (B, C, {', '.join('*' * n)}), batch first.")

    # forward: = F.instance_norm (per-example, per-channel statistics) as GroupNorm with C groups, which,
    # unlike F.instance_norm, also runs on an empty batch when affine

    def _groups(self, module, x) -> int:
        return x.shape[1]


def rms_backward(x: torch.Tensor, g: torch.Tensor, weight: Optional[torch.Tensor], eps: float, n: int,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input gradient, x̂)`` of ``out = (offset + w) ⊙ x̂``, ``x̂ = x · r``, ``r = (mean(x²) + eps)^(-1/2)`` over
    the last ``n`` elements of each row, in closed form: ``∂L/∂x = r · (h − x̂ · mean(h ⊙ x̂))`` with
    ``h = (offset + w) ⊙ g``. One normalisation, whose x̂ the per-example gradients then reuse (PyTorch has no
    RMSNorm backward kernel on the CPU, and recomputing the forward under autograd normalises twice more)."""
    shape = x.shape
    xr, gr = x.reshape(-1, n), g.reshape(-1, n)
    r = torch.linalg.vector_norm(xr, dim=1, keepdim=True).pow_(2).div_(n).add_(eps).rsqrt_()
    xh = xr * r
    h = gr if weight is None and offset == 0.0 else gr * (weight.reshape(1, n) + offset)
    gx = (h - xh * (h * xh).mean(1, keepdim=True)).mul_(r)
    return gx.view(shape), xh.view(shape)


def _fp32_eager(*tensors) -> bool:
    """fp32 tensors outside autocast: where a closed-form backward gives what autograd of the layer's own
    forward gives (its casts are then no-ops)."""
    return (all(t is None or t.dtype == torch.float32 for t in tensors)
            and not torch.is_autocast_enabled(tensors[0].device.type))


@register_rule(nn.RMSNorm)
class RMSNormRule(_AffineNormRule):
    """``nn.RMSNorm`` (weight only): per-example gradient ``Σ_positions x̂ ⊙ g``, x̂ = x / rms(x); in fp32 the input
    gradient is :func:`rms_backward`'s, whose x̂ the per-example gradients reuse."""

    rows_independent = True

    param_names = ("weight",)

    @staticmethod
    def _eps(module, x):
        """The eps the layer's forward uses: its own, or for ``eps=None`` the machine epsilon of the type
        ``F.rms_norm`` computes in (float32 for 16-bit inputs, not the input's own type)."""
        if module.eps is not None:
            return module.eps
        return torch.finfo(torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype).eps

    def forward(self, module, x, weight=None):
        return F.rms_norm(x, module.normalized_shape, weight, module.eps)  # the module's own call, eps=None too

    def _native(self, site, params):
        module, x, g = site.module, site.x, site.g
        if not _fp32_eager(x, g, *params) or x.numel() == 0:
            return None
        gx, xh = rms_backward(x, g, params[0], self._eps(module, x), math.prod(module.normalized_shape))
        return gx, x, xh

    def _per_example(self, site):
        module, x, g = site.module, site.x, site.g
        n = math.prod(module.normalized_shape)
        B = x.shape[0]
        T = x.numel() // max(B * n, 1)
        xh = self._take_xhat(site)
        if xh is None:
            xh = F.rms_norm(x.float(), module.normalized_shape, None, self._eps(module, x))
        return ((xh.reshape(B, T, n) * g.float().reshape(B, T, n)).sum(1),)
