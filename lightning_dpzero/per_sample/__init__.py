"""Per-example gradient norms and clipped gradients (Lee & Kifer 2021; Li et al. 2021; Bu et al. 2023)."""

from .base import LayerRule, RuleDoesNotApply, Site, UnsupportedLayerError
from .clipping import clip_coefficients
from .diagnostics import PerExampleMismatchError, check_per_example
from .engine import PerSampleEngine
from .registry import register_rule

# The built-in rules register themselves with ``@register_rule`` when their modules are imported; importing
# them here (not from registry.py, which they import) keeps the package's imports acyclic.
from . import attention, conv, embedding, embedding_bag, hf_conv1d, hf_norm, linear, normalization, rnn  # noqa: E402,F401  isort: skip

__all__ = ["PerSampleEngine", "LayerRule", "Site", "UnsupportedLayerError", "RuleDoesNotApply", "clip_coefficients",
           "register_rule",
           "check_per_example", "PerExampleMismatchError"]
