"""HuggingFace ``transformers.pytorch_utils.Conv1D`` (GPT-2's projections): ``out = x @ W + b``.

The weight is stored transposed relative to ``nn.Linear``: ``W`` is ``(d_in, d_out)`` (``nx``, ``nf``). For an
example with T rows ``a_t ∈ R^{d_in}`` and output gradients ``g_t ∈ R^{d_out}`` the weight gradient is
``Σ_t a_t g_tᵀ`` — the Linear gradient transposed, with the same Frobenius norm — so the Linear rule's
choice of ghost norm, instantiation or instantiate-and-reuse (Li et al. 2021; see ``paths``) applies as is;
only the instantiated and clipped gradients are transposed. The class is matched by name and module path
(see ``registry``): ``transformers`` is never imported by this package.
"""

from __future__ import annotations

import torch

from .base import UnsupportedLayerError
from .linear import LinearRule
from .maths import batch_rows, param_shape
from .registry import register_rule


@register_rule("transformers.Conv1D")  # by name: a class Conv1D anywhere under transformers
class HFConv1DRule(LinearRule):
    """HuggingFace's ``Conv1D``: the Linear rule with the weight transposed."""

    def check(self, module, name):
        w = getattr(module, "weight", None)
        nf = getattr(module, "nf", None)
        shape = tuple(param_shape(w)) if w is not None else ()
        if len(shape) != 2 or (nf is not None and shape[1] != nf):
            raise UnsupportedLayerError(
                f"Conv1D '{name}' has a weight of shape {shape}, not (nx, nf) = (d_in, d_out) as HuggingFace's "
                "transformers.pytorch_utils.Conv1D; per-example clipping supports that layout only. "
                "Fix: use nn.Linear (weight (d_out, d_in)).")

    def forward(self, module, x, weight, bias=None):
        if bias is None:
            return x.matmul(weight)
        # the class's own addmm (one rounding of product and bias in 16-bit types, where matmul + add has two)
        return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[-1])

    def grad_input(self, site, params):
        return site.g.matmul(params[0].to(site.g.dtype).t())

    def _instantiate(self, module, x, g):
        a, gg = batch_rows(x), batch_rows(g)
        return torch.bmm(a.float().transpose(1, 2), gg.float()).view(gg.shape[0], *param_shape(module.weight))

    def _weighted_weight(self, module, x, g, coef):
        # Σ_i coef_i Σ_t a_t g_tᵀ as one (d_in, d_out) matmul: no B×d_in×d_out tensor
        a, gg = batch_rows(x), batch_rows(g)
        gw = (gg * coef.to(gg.dtype).view(-1, 1, 1)).reshape(-1, gg.shape[-1])
        return a.reshape(-1, a.shape[-1]).to(gg.dtype).t().mm(gw).view(param_shape(module.weight))

    def _add_weighted_weight(self, module, x, g, coef, into):
        return False  # the clipped sum comes from :meth:`_weighted_weight`, then is added by the engine
