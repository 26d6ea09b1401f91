"""``nn.Linear`` with inputs ``(B, d)`` or ``(B, *, d)`` (Lee & Kifer 2021; Li et al. 2021 ghost norm).

For one example with T rows ``a_t ∈ R^d`` and output gradients ``g_t ∈ R^p`` the weight gradient is
``G = Σ_t g_t a_tᵀ`` (p×d). Each call takes one of three paths, chosen by :func:`.paths.weight_path` from
the shapes seen: the ghost norm then the clipped matmul, the instantiated ``(B, p, d)`` gradients' norm then
the clipped matmul, or the instantiated gradients kept on the site and reused for the clipped sum (see
:mod:`.paths` for the costs). The HF Conv1D and Conv rules are this rule with other layouts of the rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerRule
from .maths import (DOT_MAX, add_weighted_rows, batch_rows, joined, joint_rows, param_shape, per_example_sq,
                    rows_matmul, rows_norm_sq, rows_per_example, rows_sq, split_sum, weighted_rows_grad,
                    weighted_sum, weighted_sum_parts)
from .paths import weight_path
from .registry import register_rule


@register_rule(nn.Linear)
class LinearRule(LayerRule):
    """``nn.Linear``; also the base of the HF Conv1D and Conv rules (same rows, other layouts)."""

    rows_independent = True

    def forward(self, module, x, weight, bias=None):
        return F.linear(x, weight, bias)

    def grad_input(self, site, params):
        return rows_matmul(site.g, params[0].to(site.g.dtype))

    def _rows(self, module, x, g):
        """The layer as T rows per example: inputs (B, T, d) and output gradients (B, T, p)."""
        return batch_rows(x), batch_rows(g)

    def _dims(self, module, x, g) -> tuple[int, int, int, int]:
        """(B, T, d, p) of the rows (per group for grouped convolutions), without forming them."""
        return x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1], g.shape[-1]

    def _bias_rows(self, module, g):
        """Per-example bias gradients ``(B, p)`` fp32."""
        return batch_rows(g).float().sum(1)

    def _instantiate(self, module, x, g):
        """Per-example weight gradients ``(B, *weight.shape)`` fp32."""
        a, gg = self._rows(module, x, g)
        return rows_per_example(a, gg).view(gg.shape[0], *param_shape(module.weight))

    def _instantiate_parts(self, module, x, g) -> list:
        """:meth:`_instantiate` as parts along the batch, in order (one part here; convolutions form several, and
        keeping them as they are saves copying them into one tensor)."""
        return [self._instantiate(module, x, g)]

    def _instantiate_with_bias(self, module, x, g):
        """Per-example weight gradients and bias rows side by side in one buffer (:func:`.maths.joint_rows`), or
        ``None`` where a subclass forms its per-example gradients its own way or they are too large for one
        dot."""
        own = type(self)
        if (own._instantiate is not LinearRule._instantiate
                or own._instantiate_parts is not LinearRule._instantiate_parts):
            return None
        a, gg = self._rows(module, x, g)
        B, d, p = a.shape[0], a.shape[-1], gg.shape[-1]
        if p * d > DOT_MAX:
            return None
        w, b = joint_rows(B, [p * d, p], gg)
        return [rows_per_example(a, gg, out=w), torch.sum(gg.float(), 1, out=b)]

    def _weight_norm_sq(self, module, x, g, path, grams=None, plus=None):
        """Per-example squared weight-gradient norms without keeping anything (``path``: ghost or instantiate;
        ``grams``: the engine's :class:`~.maths.InputGrams`, for a ghost norm's input Gram; ``plus`` (B,): added,
        the bias's)."""
        return rows_norm_sq(*self._rows(module, x, g), path, grams, plus)

    def _weighted_weight(self, module, x, g, coef):
        """``Σ_i coef_i G_i`` in ``g``'s dtype with the weight's shape, without a per-example tensor."""
        a, gg = self._rows(module, x, g)
        return weighted_rows_grad(a, gg, coef).view(param_shape(module.weight))

    def _add_weighted_weight(self, module, x, g, coef, into) -> bool:
        """Add ``Σ_i coef_i G_i`` into ``into`` (the weight's gradient, ``g``'s dtype) in place, one ``addmm_``;
        ``False`` where the layout has no such kernel (the sum is then formed by :meth:`clipped_grads`)."""
        a, gg = self._rows(module, x, g)
        weighted_rows_grad(a, gg, coef, out=into.view(gg.shape[-1], a.shape[-1]))
        return True

    def norm_sq(self, site, mask):
        module, x, g = site.module, site.x, site.g
        w = None
        bias = len(mask) > 1 and mask[1]
        # weight and bias in one group (layer-wise, all-layer): their sum answered for the weight, in one op with
        # the weight's own (addcmul, baddbmm), and nothing for the bias
        joint = bias and mask[0] and len(site.hook.groups) == 1
        path = None
        if mask[0]:
            _, T, d, p = self._dims(module, x, g)
            path = weight_path(site, T, d, p, math.prod(param_shape(module.weight)))
        both = self._instantiate_with_bias(module, x, g) if joint and path == "reuse" else None
        if both is not None:  # kept side by side: one dot for the norms, one product for the sums
            site.kept["per_example"], site.kept["bias_rows"] = [both[0]], both[1]
            return [rows_sq(joined(both)), None]
        pb = self._bias_rows(module, g) if bias else None
        bsq = rows_sq(pb) if bias else None
        if mask[0]:
            if path == "reuse":  # kept on the site for its clipped sum
                parts = self._instantiate_parts(module, x, g)
                plus = bsq if joint else None
                w = (torch.cat([per_example_sq(part) for part in parts]) + (0 if plus is None else plus)
                     if len(parts) > 1 else per_example_sq(parts[0], plus))
                site.kept["per_example"] = parts
            else:
                w = self._weight_norm_sq(module, x, g, path, site.hook.engine.input_grams, bsq if joint else None)
        if bias:
            # (B, p): kept for the clipped sum, which would otherwise sum the output gradient's rows again, later,
            # when (all-layer clipping) they are no longer in cache
            site.kept["bias_rows"] = pb
        return [w, None if joint else bsq]

    def per_example(self, site, mask):
        module, x, g = site.module, site.x, site.g
        w = self._instantiate(module, x, g) if mask[0] else None
        b = self._bias_rows(module, g) if len(mask) > 1 and mask[1] else None
        return [w, b]

    def releases_rows(self, site):
        bias = getattr(site.module, "bias", None)
        return "per_example" in site.kept and ("bias_rows" in site.kept or bias is None or not bias.requires_grad)

    scales_sums = True

    def clipped_grads(self, site, coef, mask, alpha=1.0):
        module, x, g = site.module, site.x, site.g
        w = b = None
        kept = site.kept
        both = [kept["per_example"][0], kept["bias_rows"]] if "bias_rows" in kept and "per_example" in kept else None
        if both is not None and len(mask) > 1 and mask[0] and mask[1] and joined(both) is not None:
            del site.kept["per_example"], site.kept["bias_rows"]
            return split_sum(weighted_sum(joined(both), coef, alpha).to(site.dtype), both)
        coef = coef if alpha == 1.0 else coef * alpha
        if mask[0]:
            parts = site.kept.pop("per_example", None)
            w = (weighted_sum_parts(parts, coef).to(site.dtype) if parts is not None
                 else self._weighted_weight(module, x, g, coef))
        if len(mask) > 1 and mask[1]:
            pb = site.kept.pop("bias_rows", None)
            b = weighted_sum(pb if pb is not None else self._bias_rows(module, g), coef).to(site.dtype)
        return [w, b]

    def add_clipped_grads(self, site, coef, mask, into):
        mask = list(mask)
        if (mask[0] and into[0] is not None and "per_example" not in site.kept
                and self._add_weighted_weight(site.module, site.x, site.g, coef, into[0])):
            mask[0] = False
        if len(mask) > 1 and mask[1] and "bias_rows" in site.kept and add_weighted_rows(
                into[1], site.kept["bias_rows"], coef):  # the bias's sum added in place too: one addmm_
            del site.kept["bias_rows"]
            mask[1] = False
        return self.clipped_grads(site, coef, mask)
