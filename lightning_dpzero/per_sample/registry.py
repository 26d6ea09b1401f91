"""Which rule handles which module type. One layer family per file; registered here."""

from __future__ import annotations

from typing import Optional

from torch import nn

from .base import LayerRule
from .conv import Conv2dRule
from .embedding import EmbeddingRule
from .linear import LinearRule
from .normalization import GroupNormRule, LayerNormRule

RULES: dict[type, LayerRule] = {}


def register_rule(rule: LayerRule) -> None:
    """Register ``rule`` for each of its ``module_types`` (exact type match)."""
    for t in rule.module_types:
        RULES[t] = rule


for _rule in (LinearRule(), Conv2dRule(), EmbeddingRule(), LayerNormRule(), GroupNormRule()):
    register_rule(_rule)

_HINTS = {
    "BatchNorm": "BatchNorm mixes examples in a batch, so no per-example gradient exists; use GroupNorm or LayerNorm",
    "SyncBatchNorm": "BatchNorm mixes examples in a batch; use GroupNorm or LayerNorm",
}


def find_rule(module: nn.Module) -> Optional[LayerRule]:
    return RULES.get(type(module))


def unsupported_reason(module: nn.Module) -> str:
    name = type(module).__name__
    for key, hint in _HINTS.items():
        if name.startswith(key):
            return hint
    for t in RULES:
        if isinstance(module, t):
            return (f"subclasses of {t.__name__} are not supported yet (the subclass may change the forward); "
                    f"use {t.__name__} itself")
    supported = ", ".join(sorted(t.__name__ for t in RULES))
    return f"no per-example rule for {name} (supported: {supported})"
