"""HuggingFace's RMSNorm family (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``MistralRMSNorm``, ``GemmaRMSNorm``,
``T5LayerNorm``, ...), matched by class name under ``transformers`` (never imported here).

These classes differ only in the dtype casts and in whether the weight multiplies as ``w`` or ``1 + w``
(Gemma): ``out = (c + w) ⊙ x̂`` with ``x̂ = x / sqrt(mean(x²) + eps)`` over the last dimension and c = 0 or 1.
Either way example i's weight gradient is ``Σ_positions x̂ ⊙ g`` (computed in fp32), as for ``nn.RMSNorm``;
the forward is the class's own (its casts as written). It is faster than the generic rule on such a layer
(``benchmarks/per_layer.py``: LlamaRMSNorm d=256, T=128, B=16, 1.51× non-DP against 1.71×). Before training, :meth:`HFRMSNormRule.check` runs the class's
forward on a random input and weight and requires that identity (c = 0 or 1); a class that computes anything
else (a future version, a same-named class of another model) gets the generic rule instead.
"""

from __future__ import annotations

import contextlib

import torch

from .base import RuleDoesNotApply
from .normalization import _AffineNormRule, _fp32_eager, rms_backward
from .registry import register_rule

#: the classes matched by name (any other RMSNorm of transformers gets the generic rule, which is exact too)
HF_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm",
                "MistralRMSNorm", "MixtralRMSNorm", "Phi3RMSNorm", "GemmaRMSNorm", "Gemma2RMSNorm",
                "Gemma3RMSNorm", "Olmo2RMSNorm", "GraniteRMSNorm", "DeepseekV3RMSNorm", "SmolLM3RMSNorm",
                "T5LayerNorm", "MT5LayerNorm", "UMT5LayerNorm", "LongT5LayerNorm")


#: per class, the c of ``(c + w) ⊙ x̂`` that :meth:`HFRMSNormRule.check` found (a fact of the class's code)
_OFFSETS: dict[type, float] = {}


def _eps(module):
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps if isinstance(eps, float) else None


@contextlib.contextmanager
def _weight(module, weight):
    """The class's forward reads ``weight`` in place of the module's parameter (instance dictionary)."""
    module.__dict__["weight"] = weight
    try:
        yield
    finally:
        module.__dict__.pop("weight", None)


@register_rule(*[f"transformers.{name}" for name in HF_RMS_NORMS])
class HFRMSNormRule(_AffineNormRule):
    """``out = (c + w) ⊙ x / rms(x)`` over the last dimension, weight only; the forward is the class's own."""

    rows_independent = True

    param_names = ("weight",)

    def check(self, module, name):
        w = module._parameters.get("weight")
        d = int(getattr(w, "ds_shape", w.shape)[0]) if w is not None and w.dim() == 1 else None
        eps = _eps(module)
        if d is None or eps is None:
            raise RuleDoesNotApply(f"{type(module).__name__} '{name}' has no (d,) weight and float eps")
        gen = torch.Generator().manual_seed(0)
        x, wr = torch.randn(2, 3, d, generator=gen), torch.randn(d, generator=gen)
        with torch.no_grad(), _weight(module, wr):
            out = type(module).forward(module, x).float()
        xh = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        offsets = [c for c in (0.0, 1.0) if torch.allclose(out, (wr + c) * xh, rtol=1e-4, atol=1e-5)]
        if not offsets:
            raise RuleDoesNotApply(f"{type(module).__name__} '{name}' computes something else")
        _OFFSETS[type(module)] = offsets[0]

    def forward(self, module, x, weight):
        with _weight(module, weight):
            return type(module).forward(module, x)

    def _native(self, site, params):
        """In fp32 (where the class's casts are no-ops) the closed form of :func:`.normalization.rms_backward`;
        otherwise ``None``: the class's forward recomputed under autograd."""
        x, g, offset = site.x, site.g, _OFFSETS.get(type(site.module))
        if offset is None or not _fp32_eager(x, g, *params) or x.numel() == 0:
            return None
        gx, xh = rms_backward(x, g, params[0], _eps(site.module), x.shape[-1], offset)
        return gx, x, xh

    def _per_example(self, site):
        x, g = site.x, site.g
        xh = self._take_xhat(site)
        if xh is None:
            xf = x.float()
            xh = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _eps(site.module))
        return ((xh * g.float()).reshape(x.shape[0], -1, x.shape[-1]).sum(1),)
