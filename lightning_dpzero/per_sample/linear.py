"""``nn.Linear`` with inputs ``(B, d)`` or ``(B, *, d)`` (Lee & Kifer 2021; Li et al. 2021 ghost norm).

For one example with T rows ``a_t ∈ R^d`` and output gradients ``g_t ∈ R^p`` the weight gradient is
``G = Σ_t g_t a_tᵀ`` (p×d). Each call takes one of three paths, chosen by :func:`.paths.weight_path` from
the shapes seen: the ghost norm then the clipped matmul, the instantiated ``(B, p, d)`` gradients' norm then
the clipped matmul, or the instantiated gradients kept on the site and reused for the clipped sum (see
:mod:`.paths` for the costs). The HF Conv1D and Conv rules are this rule with other layouts of the rows.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .base import LayerRule
from .maths import (batch_rows, param_shape, per_example_sq, rows_norm_sq, rows_per_example, weighted_rows_grad,
                    weighted_sum)
from .paths import choose_path, fits_deferred


class KeptSites:
    """Per-example tensors a rule formed for a site's norm, kept for the same site's clipped sum.

    Keyed weakly by the site's output gradient ``g`` (the engine's records hold it until the clipped sum is
    formed), so an entry can never outlive its site: if the pass is abandoned, the entry goes with ``g``.
    ``x`` is checked by identity too."""

    def __init__(self):
        self._d = WeakIdKeyDictionary()

    def put(self, x, g, value) -> None:
        self._d[g] = (x, value)

    def take(self, x, g):
        hit = self._d.pop(g, None)
        return hit[1] if hit is not None and hit[0] is x else None

    def __len__(self) -> int:
        return len(self._d)


def kept_sites(rule) -> KeptSites:
    """The rule instance's store (rules are shared by every layer of their type)."""
    store = rule.__dict__.get("_kept_sites")
    if store is None:
        store = rule._kept_sites = KeptSites()
    return store


class LinearRule(LayerRule):
    """``nn.Linear``; also the base of the HF Conv1D and Conv rules (same rows, other layouts)."""

    module_types = (nn.Linear,)
    #: ``norm_sq`` accepts ``keep=True`` (the engine forms the clipped sum right after, at this site)
    keeps_per_example = True

    #: the last choice made (``"reuse"``/``"ghost"``/``"instantiate"``), for benchmarks and tests
    last_path: Optional[str] = None

    def forward(self, module, x, weight, bias=None):
        return F.linear(x, weight, bias)

    def grad_input(self, module, x, params, g):
        return g.matmul(params[0].to(g.dtype))

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

    def _weight_norm_sq(self, module, x, g, path):
        """Per-example squared weight-gradient norms without keeping anything (``path``: ghost or instantiate)."""
        return rows_norm_sq(*self._rows(module, x, g), path)

    def _weighted_weight(self, module, x, g, coef):
        """``Σ_i coef_i G_i`` in ``g``'s dtype with the weight's shape, without a per-example tensor."""
        a, gg = self._rows(module, x, g)
        return weighted_rows_grad(a, gg, coef).view(param_shape(module.weight))

    def norm_sq(self, module, x, g, mask, keep: bool = False):
        w = None
        bias = len(mask) > 1 and mask[1]
        pb = self._bias_rows(module, g) if bias else None
        if mask[0]:
            B, T, d, p = self._dims(module, x, g)
            reusable = B > 0 and (keep or fits_deferred(x, g, math.prod(param_shape(module.weight))))
            path = choose_path(T, d, p, reusable, g.device.type, g.dtype)
            self.last_path = path
            if path == "reuse":
                per = self._instantiate(module, x, g)
                w = per_example_sq(per)
                kept_sites(self).put(x, g, (per, pb))
            else:
                w = self._weight_norm_sq(module, x, g, path)
        return [w, pb.pow(2).sum(1) if bias else None]

    def per_example(self, module, x, g, mask):
        w = self._instantiate(module, x, g) if mask[0] else None
        b = self._bias_rows(module, g) if len(mask) > 1 and mask[1] else None
        return [w, b]

    def clipped_grads(self, module, x, g, coef, mask):
        w = b = None
        kept = kept_sites(self).take(x, g) if mask[0] else None
        if mask[0]:
            w = weighted_sum(kept[0], coef).to(g.dtype) if kept is not None else self._weighted_weight(module, x, g, coef)
        if len(mask) > 1 and mask[1]:
            pb = kept[1] if kept is not None and kept[1] is not None else self._bias_rows(module, g)
            b = weighted_sum(pb, coef).to(g.dtype)
        return [w, b]
