"""``nn.Linear`` with inputs ``(B, d)`` or ``(B, *, d)`` (Lee & Kifer 2021; Li et al. 2021 ghost norm).

For one example with T rows ``a_t ∈ R^d`` and output gradients ``g_t ∈ R^p`` the weight gradient is
``G = Σ_t g_t a_tᵀ`` (p×d). Three ways to get its squared norm and the clipped sum ``Σ_i c_i G_i``:

* **ghost + matmul**: ``‖G‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s)`` (extra cost ``2T²(d+p)`` flops, memory
  ``O(T²)``), then the clipped sum as one matmul of coefficient-scaled output gradients: the matmul a non-DP
  backward does anyway, so the norm is the only extra work;
* **instantiate + matmul**: ``‖G‖²`` from the ``(B, p, d)`` per-example tensor (an extra ``2T·p·d`` flops
  and a ``B·p·d`` tensor), then the same matmul;
* **instantiate and reuse**: the per-example ``G_i`` (their bmm costs the multiply-adds of the batch
  weight gradient it replaces) give the norm *and* the clipped sum ``Σ_i c_i G_i`` (a ``(B,)·(B, p·d)``
  product): no second matmul; the extra cost is memory traffic over ``B·p·d`` values (written once, read
  for the norm and for the sum). Only possible when the clipped sum is formed right after the norm at the
  same site (the engine passes ``keep=True`` to ``norm_sq`` then: layer-wise clipping, whose groups complete
  at their own site). For groups completed at the end of backward (all-layer, group-wise spanning layers)
  keeping ``B·p·d`` per layer until then costs memory: such a site keeps only when that is at most
  :data:`DEFERRED_KEEP_FACTOR` of what the engine records for it anyway (input and output gradient): small
  convolution kernels, never a GPT-width Linear.

The choice is made per call from the shapes actually seen (:func:`choose_path`), by a cost model that
counts the extra flops of the ghost norm against the memory traffic of instantiation, with a memory cap
(the per-example tensor at most :data:`REUSE_MEMORY_FACTOR` times the layer's own input rows and output
gradients): no ``B·p·d`` tensor for a layer whose ghost norm is cheaper.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .base import LayerRule, batch_rows, param_shape

#: flop-equivalents of one per-example-gradient element kept for reuse (written once, read twice, fp32),
#: by device type. CPU: fitted to ``benchmarks/per_layer.py`` (T=128: d=p=256 → ≈46, d=256 p=1024 → ≈84,
#: T=512 d=p=64 → ≈90; the prototype's measured excess over non-DP, divided by p·d). CUDA: a roofline
#: estimate, not measured (12 bytes per element at ~4 TB/s against ~800 TFLOP/s of 16-bit tensor cores, or
#: ~60 TFLOP/s in fp32): ``benchmarks/gpu.sh`` measures the per-layer paths on a GPU.
REUSE_COST = {"cpu": 64.0, "cuda": 2000.0, "cuda_fp32": 200.0}
#: reuse only when ``p·d ≤ REUSE_MEMORY_FACTOR · T·(d+p)``: the per-example gradients at most this many times
#: the layer's own rows (input and output gradient) — bounds the peak memory a layer adds in its backward
REUSE_MEMORY_FACTOR = 2.0
#: a site whose group completes later (all-layer, group-wise) keeps its per-example gradients until then only
#: when they are at most this fraction of what the engine already records for the site (its input and output
#: gradient): small convolution kernels and normalisation layers, never a GPT-width Linear
DEFERRED_KEEP_FACTOR = 0.5


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


def fits_deferred(x, g, per_example_numel: int) -> bool:
    """May a site that does not complete its group keep ``B × per_example_numel`` values until it does?"""
    return x.shape[0] * per_example_numel <= DEFERRED_KEEP_FACTOR * (x.numel() + g.numel())


def use_ghost(T: int, d: int, p: int) -> bool:
    """For the norm alone: ghost when ``2T² < p·d`` (Bu et al. 2022, book-keeping layer-wise decision)."""
    return 2 * T * T < p * d


def use_reuse(T: int, d: int, p: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> bool:
    """Instantiate-and-reuse beats ghost + matmul (see the module docstring), where reuse is possible."""
    if T <= 1 or p * d > REUSE_MEMORY_FACTOR * T * (d + p):
        return False
    if device == "cuda":
        beta = REUSE_COST["cuda_fp32" if dtype == torch.float32 else "cuda"]
    else:
        beta = REUSE_COST.get(device, REUSE_COST["cpu"])
    return beta * p * d < 2 * T * T * (d + p) + 3 * T * T


def choose_path(T: int, d: int, p: int, reusable: bool, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> str:
    """``"reuse"``, ``"ghost"`` or ``"instantiate"`` for one call (``reusable``: the site completes here)."""
    if reusable and use_reuse(T, d, p, device, dtype):
        return "reuse"
    return "ghost" if T > 1 and use_ghost(T, d, p) else "instantiate"


def rows_norm_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-example ‖Σ_t g_t a_tᵀ‖² for ``a`` (B,T,d), ``g`` (B,T,p), returned fp32 ``(B,)``."""
    a, g = a.float(), g.float()
    B, T, d = a.shape
    p = g.shape[-1]
    if T == 1:
        return a.pow(2).sum((1, 2)) * g.pow(2).sum((1, 2))
    if use_ghost(T, d, p):
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
    return per_example_sq(torch.bmm(g.transpose(1, 2), a))


def per_example_sq(t: torch.Tensor) -> torch.Tensor:
    """Squared norm of each example's slice of ``t`` (B, ...), fp32 ``(B,)``, without a squared copy of ``t``."""
    return torch.linalg.vector_norm(t.flatten(1).float(), dim=1).pow(2)


def weighted_rows_grad(a: torch.Tensor, g: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``Σ_i coef_i Σ_t g_{i,t} a_{i,t}ᵀ`` as a (p, d) matrix in ``g``'s dtype: one matmul, no B×p×d tensor."""
    gw = g * coef.to(g.dtype).view(-1, 1, 1)
    return gw.reshape(-1, g.shape[-1]).t().mm(a.reshape(-1, a.shape[-1]).to(g.dtype))


def weighted_sum(per: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``Σ_i coef_i · per_i`` for ``per`` (B, ...) fp32: one ``(B,)·(B, n)`` product, shape ``per.shape[1:]``."""
    return coef.to(per.dtype).view(1, -1).mm(per.flatten(1)).view(per.shape[1:])


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
        return torch.bmm(gg.float().transpose(1, 2), a.float()).view(gg.shape[0], *param_shape(module.weight))

    def _weight_norm_sq(self, module, x, g):
        """Per-example squared weight-gradient norms without keeping anything (ghost or instantiated)."""
        return rows_norm_sq(*self._rows(module, x, g))

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
                w = self._weight_norm_sq(module, x, g)
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
