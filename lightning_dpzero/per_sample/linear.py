"""``nn.Linear`` with inputs ``(B, d)`` or ``(B, *, d)`` (Lee & Kifer 2021; Li et al. 2021 ghost norm).

For one example with T rows ``a_t ∈ R^d`` and output gradients ``g_t ∈ R^p`` the weight gradient is
``G = Σ_t g_t a_tᵀ`` (p×d). Its squared norm is either

* ghost: ``Σ_{t,s} (a_t·a_s)(g_t·g_s)``, cost ``O(T²(d+p))``, memory ``O(T²)``; or
* instantiated: ``‖G‖²`` from the ``(B, p, d)`` tensor, cost ``O(T·p·d)``.

The cheaper one is chosen per call from the shapes actually seen: ghost when ``2T² < p·d``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerRule, batch_rows, param_shape


def use_ghost(T: int, d: int, p: int) -> bool:
    """Ghost norm when ``2T² < p·d`` (Bu et al. 2022, book-keeping layer-wise decision)."""
    return 2 * T * T < p * d


def rows_norm_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-example ‖Σ_t g_t a_tᵀ‖² for ``a`` (B,T,d), ``g`` (B,T,p), returned fp32 ``(B,)``."""
    a, g = a.float(), g.float()
    B, T, d = a.shape
    p = g.shape[-1]
    if T == 1:
        return a.pow(2).sum((1, 2)) * g.pow(2).sum((1, 2))
    if use_ghost(T, d, p):
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
    return torch.bmm(g.transpose(1, 2), a).pow(2).sum((1, 2))


def weighted_rows_grad(a: torch.Tensor, g: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``Σ_i coef_i Σ_t g_{i,t} a_{i,t}ᵀ`` as a (p, d) matrix in ``g``'s dtype: one matmul, no B×p×d tensor."""
    gw = g * coef.to(g.dtype).view(-1, 1, 1)
    return gw.reshape(-1, g.shape[-1]).t().mm(a.reshape(-1, a.shape[-1]).to(g.dtype))


class LinearRule(LayerRule):
    module_types = (nn.Linear,)

    def forward(self, module, x, weight, bias=None):
        return F.linear(x, weight, bias)

    def grad_input(self, module, x, params, g):
        return g.matmul(params[0].to(g.dtype))

    def _rows(self, module, x, g):
        """The layer as T rows per example: inputs (B, T, d) and output gradients (B, T, p)."""
        return batch_rows(x), batch_rows(g)

    def norm_sq(self, module, x, g, mask):
        a, gg = self._rows(module, x, g)
        w = rows_norm_sq(a, gg) if mask[0] else None
        b = gg.float().sum(1).pow(2).sum(1) if len(mask) > 1 and mask[1] else None
        return [w, b]

    def per_example(self, module, x, g, mask):
        a, gg = self._rows(module, x, g)
        B = gg.shape[0]
        w = torch.bmm(gg.float().transpose(1, 2), a.float()).view(B, *param_shape(module.weight)) if mask[0] else None
        b = gg.float().sum(1) if len(mask) > 1 and mask[1] else None
        return [w, b]

    def clipped_grads(self, module, x, g, coef, mask):
        a, gg = self._rows(module, x, g)
        w = weighted_rows_grad(a, gg, coef).view(param_shape(module.weight)) if mask[0] else None
        b = None
        if len(mask) > 1 and mask[1]:
            b = (gg.float().sum(1) * coef.view(-1, 1)).sum(0).to(g.dtype)
        return [w, b]
