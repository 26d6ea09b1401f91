"""``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d`` as a Linear over unfolded patches (Lee & Kifer 2021, §4).

Unfolding (im2col) turns one example's input into T rows (one per output position, T = Π out_spatial) of
d = C_in·Π kernel values, and its output gradient into T rows of p = C_out values; the weight gradient is
then ``Σ_t g_t a_tᵀ``, a Linear's, so the Linear rule's choice among ghost norm, instantiation and
instantiate-and-reuse (Li et al. 2021; Bu et al. 2023; see ``paths``) applies unchanged. Where the
per-example gradients were not kept, the clipped sum is PyTorch's own weight-gradient kernel
(``aten.convolution_backward``, the non-DP backward's) on coefficient-scaled output gradients: no
second unfold. Per-example gradients, norms and clipped sums are formed for part of the batch at a time
(``paths.norm_chunk``): PyTorch's kernels copy their inputs, and the unfolded rows are k² times the input, so
a whole batch at once made these the largest tensors of a DP step; the parts bound them, and were measured
faster too (they stay in cache).

Supported: any stride, dilation, padding (int, tuple, ``'valid'``, ``'same'`` also when asymmetric), every
``padding_mode`` (the input is padded explicitly, then unfolded without padding), and ``groups`` G: group j
maps channels ``j·C_in/G …`` to outputs ``j·C_out/G …``, so the per-example weight gradient is G blocks
``(C_out/G, C_in/G·Πk)``; the groups are folded into the batch for norms (``(B·G, T, d/G)`` rows, squared
norms summed per example); the weight-gradient kernel takes ``groups`` itself. Inputs must be batched
``(B, C_in, *spatial)``; unbatched inputs are refused at the forward.

Patch extraction: ``F.unfold`` for 2-D (1-D as 2-D with height 1); 3-D with ``Tensor.unfold`` per spatial
dimension (a window of ``dilation·(k−1)+1`` then every ``dilation``-th element).

Per-example weight gradients come from PyTorch's grouped weight-gradient kernel, the batch folded into the
groups, except for layers with at most :data:`FEW_CHANNELS` input channels per group (an image model's first
layer, depthwise convolutions), where that kernel is slow: there they are one batched product of the output
gradient with the input's patches, taken as strided slices of the padded input (:func:`strided_patches`).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerRule, UnsupportedLayerError
from .linear import LinearRule
from .maths import param_shape, per_example_sq, rows_norm_sq
from .paths import norm_chunk
from .registry import register_rule


#: Input channels per group up to which per-example weight gradients are a batched product over strided
#: patches instead of the grouped kernel. Measured on one CPU thread, the benchmark CNN's first layer (3 → 32
#: channels, 32×32, batch 64, parts of 8 to 32): 3.1-3.9 ms against 6.6-10.5 ms (1 input channel: 0.9-1.2
#: against 1.6-2.1 ms); from 8 input channels on, the grouped kernel was the faster (5.1 against 6.3 ms).
FEW_CHANNELS = 4

#: Examples per call of the per-example weight-gradient kernel that a site keeping its per-example gradients
#: (``"reuse"``) grows its parts towards where the memory bound of :func:`.paths.norm_chunk` gives fewer, as far
#: as a part's temporaries stay within the per-example gradients the site keeps anyway (so parts may stay
#: smaller): the grouped kernel is slow on few groups. Measured on one CPU thread, the benchmark CNN's third
#: layer (64 → 64 channels, 16×16, batch 64): 7.0, 6.1 and 5.9 ms in parts of 4, 8 and 16 examples; the memory
#: bound alone gave it parts of 6, and parts of 16 took the whole layer-wise step from 1.20-1.22 to 1.18-1.20 of
#: non-DP's time, 1.2-1.6% less (non-DP and both versions taking turns, 300 steps each, four launches).
REUSE_PART_TARGET = 16


def _weight_grad(module, x, weight, g, padding, groups: int) -> torch.Tensor:
    """PyTorch's weight-gradient kernel (the one autograd runs for the layer; ``weight`` only gives the shape:
    its values are not read)."""
    n = len(module.kernel_size)
    return torch.ops.aten.convolution_backward(
        g, x, weight, None, list(module.stride), list(padding), list(module.dilation), False, [0] * n, groups,
        [False, True, False])[1]


def _input_grad(module, input_shape, weight, g, padding) -> torch.Tensor:
    """The input gradient as the transposed convolution of the output gradient: what autograd's backward kernel
    computes (the same oneDNN primitive on the CPU), but without the input itself, which that kernel copies
    (``convolution_backward`` makes it contiguous even where only the input gradient is asked for): at the
    layer where a CNN's backward peaks (its widest input) that copy was the largest tensor formed."""
    n = len(module.kernel_size)
    # the input positions the forward's floor division left over (0 ≤ extra < stride, as PyTorch requires)
    extra = [i - ((o - 1) * s - 2 * p + d * (k - 1) + 1) for i, o, s, p, d, k in
             zip(input_shape[2:], g.shape[2:], module.stride, padding, module.dilation, module.kernel_size)]
    transpose = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[n - 1]
    return transpose(g, weight, None, module.stride, padding, extra, module.groups, module.dilation)


def _pads(module) -> list[tuple[int, int]]:
    """(left, right) zero/mode padding per spatial dimension, as PyTorch applies it."""
    n = len(module.kernel_size)
    if module.padding == "valid":
        return [(0, 0)] * n
    if module.padding == "same":
        tot = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
        return [(t // 2, t - t // 2) for t in tot]
    return [(p, p) for p in module.padding]


def _pad_explicitly(module, x: torch.Tensor) -> torch.Tensor:
    """``x`` padded as the layer pads it (its ``padding_mode``, asymmetric ``'same'`` too)."""
    flat = [v for lr in reversed(_pads(module)) for v in lr]
    if not any(flat):
        return x
    return F.pad(x, flat, mode="constant" if module.padding_mode == "zeros" else module.padding_mode)


def _kernels_cannot_pad(module) -> bool:
    """PyTorch's convolution kernels pad with zeros, symmetrically: other padding is applied beforehand."""
    return module.padding_mode != "zeros" or any(l != r for l, r in _pads(module))


def unfold_patches(module, x: torch.Tensor) -> torch.Tensor:
    """``(B, C, *spatial)`` → rows ``(B, T, C·Πk)`` (channel-major, like the flattened weight)."""
    n = len(module.kernel_size)
    x = _pad_explicitly(module, x)
    B, C = x.shape[0], x.shape[1]
    K = math.prod(module.kernel_size)
    if n <= 2:
        pre = (1,) * (2 - n)
        x4 = x.reshape(B, C, *pre, *x.shape[2:])
        a = F.unfold(x4, pre + tuple(module.kernel_size), pre + tuple(module.dilation), 0, pre + tuple(module.stride))
        return a.transpose(1, 2)
    for i, (k, s, d) in enumerate(zip(module.kernel_size, module.stride, module.dilation)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)[..., ::d]  # appends the window as the last dimension
    T = math.prod(x.shape[2:2 + n])
    perm = (0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n))
    return x.permute(*perm).reshape(B, T, C * K)


def strided_patches(module, x: torch.Tensor, out_size) -> torch.Tensor:
    """``(B, C, *spatial)`` → patches ``(B, C·Πk, T)`` (channel-major, like the flattened weight; T = Π
    ``out_size``, the output's spatial size): the padded input sliced once per kernel offset, with the layer's
    stride and dilation, the slices stacked. Plain copies of the input, no im2col kernel."""
    x = _pad_explicitly(module, x)
    B, C = x.shape[0], x.shape[1]
    offsets = itertools.product(*(range(k) for k in module.kernel_size))
    slices = [x[(..., *(slice(o * d, o * d + s * (n - 1) + 1, s)
                        for o, d, s, n in zip(off, module.dilation, module.stride, out_size)))]
              for off in offsets]
    return torch.stack(slices, 2).reshape(B, C * len(slices), math.prod(out_size))


def _fold_groups(t: torch.Tensor, G: int) -> torch.Tensor:
    """Rows ``(B, T, G·k)`` → ``(B·G, T, k)``: each (example, group) pair as its own Linear example."""
    B, T, D = t.shape
    return t.reshape(B, T, G, D // G).transpose(1, 2).reshape(B * G, T, D // G)


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(LinearRule):
    """Conv1d/2d/3d; shares the Linear rule's norms and kept per-example gradients, only the rows differ."""
    forward_methods = ("forward", "_conv_forward")
    rows_independent = False

    def forward(self, module, x, weight, bias=None):
        n = len(module.kernel_size)
        if x.dim() != n + 2:
            raise UnsupportedLayerError(
                f"{type(module).__name__} received an input of shape {tuple(x.shape)}; per-example clipping "
                f"needs a batched input (B, C, {', '.join('*' * n)}), batch first.")
        return module._conv_forward(x, weight, bias)  # PyTorch's own: padding modes, asymmetric 'same'

    def grad_input(self, site, params):
        module, x, g = site.module, site.x, site.g
        if _kernels_cannot_pad(module):
            return LayerRule.grad_input(self, site, params)  # recompute through F.pad
        weight, padding = params[0].to(g.dtype), [l for l, _ in _pads(module)]
        parts = self._parts(module, x, g, "input") if g.device.type == "cpu" else [slice(None)]
        if len(parts) == 1:
            return _input_grad(module, x.shape, weight, g, padding)
        # on the CPU a part of the batch at a time, into one tensor: the kernel's copies of its output gradient
        # and of its result (2-3× the layer's input) then stay a part's
        gx = torch.empty(x.shape, dtype=g.dtype, device=g.device)
        for s in parts:
            gx[s] = _input_grad(module, gx[s].shape, weight, g[s], padding)
        return gx

    def _rows(self, module, x, g):
        return unfold_patches(module, x), g.flatten(2).transpose(1, 2)  # (B,T,d), (B,T,p)

    def _dims(self, module, x, g):
        shape = param_shape(module.weight)  # (C_out, C_in/G, *k)
        return x.shape[0], math.prod(g.shape[2:]), math.prod(shape[1:]), shape[0] // module.groups

    def _bias_rows(self, module, g):
        return g.flatten(2).float().sum(2)

    def _padded(self, module, x):
        """The input and the padding to give PyTorch's kernels (explicitly padded where they cannot pad)."""
        if _kernels_cannot_pad(module):
            return _pad_explicitly(module, x), [0] * len(module.kernel_size)
        return x, [l for l, _ in _pads(module)]

    def _parts(self, module, x, g, work: str) -> list[slice]:
        """The batch in parts (:func:`.paths.norm_chunk`) for ``work``, by its temporaries per example:
        ``"ghost"``, the ghost norm's unfolded rows and two Gram matrices per group; ``"instantiate"`` (norms
        only) and ``"reuse"`` (the per-example gradients kept: the larger of the memory bound's parts and parts of
        up to :data:`REUSE_PART_TARGET` examples whose temporaries stay within what is kept), the grouped kernel's
        copies of the example's input and output gradient and its weight gradient (formed, then copied out), or a
        few-channel layer's strided patches; ``"sum"``, the weight-gradient kernel's copies of the
        input and output gradient and the scaled copy of the smaller; ``"input"``, the transposed convolution's
        copy of the output gradient and its result with a copy of it (:meth:`grad_input`)."""
        B, T, d, p = self._dims(module, x, g)
        G = module.groups
        rows = (x.numel() + g.numel()) // max(1, B)
        # the same temporaries whether the gradients are kept or not; a few-channel layer's strided patches are
        # G·T·d values an example (:meth:`_instantiate_part`)
        instantiate = rows + 2 * G * p * d + (G * T * d if module.in_channels // G <= FEW_CHANNELS else 0)
        per = {"ghost": G * (T * (d + p) + 2 * T * T), "instantiate": instantiate, "reuse": instantiate,
               "sum": rows + min(x.numel(), g.numel()) // max(1, B),
               "input": (g.numel() + 2 * x.numel()) // max(1, B)}[work]
        k = norm_chunk(x, g, per)
        if work == "reuse" and k < REUSE_PART_TARGET:
            # larger parts, their temporaries within the per-example gradients the site keeps anyway
            k = max(k, min(REUSE_PART_TARGET, B * G * p * d // max(1, per)))
        if B <= k:
            return [slice(None)]
        k = -(-B // -(-B // k))  # the same number of parts, of even sizes (64 by 18: 4 parts of 16)
        return [slice(i, i + k) for i in range(0, B, k)]

    def _instantiate(self, module, x, g):
        """Per-example weight gradients ``(B, C_out, C_in/G, *k)`` fp32 (:meth:`_instantiate_parts`, joined)."""
        parts = self._instantiate_parts(module, x, g)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _instantiate_parts(self, module, x, g):
        """The per-example weight gradients of each part of the batch (:meth:`_parts`): beside bounding the
        kernel's temporaries, parts that stay in cache were measured faster here (4 to 8 examples of the
        benchmark CNN's 32: 1.6-2× on its two wider layers)."""
        return [self._instantiate_part(module, x[s], g[s]) for s in self._parts(module, x, g, "reuse")]

    def _instantiate_part(self, module, x, g):
        """One grouped weight-gradient kernel call, the batch folded into the channels (B·G groups; Rochette et
        al. 2019): no unfold, the same kernel family as non-DP; with few input channels per group
        (:data:`FEW_CHANNELS`), one batched product over :func:`strided_patches` (the bmm's product dimension
        last in both operands, T, where MKL was fastest)."""
        shape = param_shape(module.weight)
        B = x.shape[0]
        if B == 0:
            return torch.zeros(0, *shape, dtype=torch.float32, device=g.device)
        G = module.groups
        if module.in_channels // G <= FEW_CHANNELS:
            P = strided_patches(module, x.float(), g.shape[2:])  # (B, C_in·Πk, T)
            T = P.shape[2]
            P = P.view(B * G, P.shape[1] // G, T)
            rows = torch.bmm(P, g.float().reshape(B * G, shape[0] // G, T).transpose(1, 2))  # (B·G, d/G, p/G)
            return rows.view(B, G, *rows.shape[1:]).transpose(2, 3).reshape(B, *shape)
        xin, padding = self._padded(module, x.float())
        gf = g.float()
        dummy = torch.empty((B * shape[0], *shape[1:]), dtype=torch.float32, device=g.device)
        w = _weight_grad(module, xin.reshape(1, B * xin.shape[1], *xin.shape[2:]), dummy,
                         gf.reshape(1, B * gf.shape[1], *gf.shape[2:]), padding, B * module.groups)
        return w.view(B, *shape)

    def _weight_norm_sq(self, module, x, g, path, grams=None, plus=None):  # unfolded rows are never shared
        """The norms alone, a part of the batch at a time (:meth:`_parts`); ``plus`` (B,) added (the bias's)."""
        parts = self._parts(module, x, g, path)
        if len(parts) == 1:
            out = self._norm_sq_of(module, x, g, path)
        else:
            out = torch.cat([self._norm_sq_of(module, x[s], g[s], path) for s in parts])
        return out if plus is None else out + plus

    def _norm_sq_of(self, module, x, g, path):
        B, T = x.shape[0], math.prod(g.shape[2:])
        if T > 1 and path == "instantiate":  # one grouped kernel call, no unfold
            return per_example_sq(self._instantiate_part(module, x, g))
        a, gg = self._rows(module, x, g)
        G = module.groups
        if G == 1:
            return rows_norm_sq(a, gg, path)
        return rows_norm_sq(_fold_groups(a, G), _fold_groups(gg, G), path).view(B, G).sum(1)

    def _weighted_weight(self, module, x, g, coef):
        """``Σ_i coef_i G_i`` with PyTorch's own weight-gradient kernel (the non-DP backward's; no unfold, no
        per-example tensor) on the input or the output gradient scaled by the coefficients, whichever is
        smaller (the weight gradient is linear in each; padding, of any mode, commutes with the scaling), summed
        over parts of the batch (:meth:`_parts`: the kernel copies both)."""
        shape = param_shape(module.weight)
        if x.shape[0] == 0:
            return torch.zeros(shape, dtype=g.dtype, device=g.device)
        c = coef.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))
        x, out = x.to(g.dtype), None
        dummy = torch.empty(shape, dtype=g.dtype, device=g.device)
        for s in self._parts(module, x, g, "sum"):
            xs, gs = (x[s] * c[s], g[s]) if x.numel() < g.numel() else (x[s], g[s] * c[s])
            xin, padding = self._padded(module, xs)
            part = _weight_grad(module, xin, dummy, gs, padding, module.groups)
            out = part if out is None else out.add_(part)
        return out

    def _add_weighted_weight(self, module, x, g, coef, into):
        return False  # the clipped sum comes from :meth:`_weighted_weight`, then is added by the engine
