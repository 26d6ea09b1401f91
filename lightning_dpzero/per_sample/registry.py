"""Which rule handles which module. One layer family per file; registered here.

A module is matched, in order, by its exact type, by its class name and module path (layers of optional
libraries, e.g. HuggingFace's ``Conv1D``, so that ``transformers`` is never imported here), then as a
subclass of a registered type that overrides none of the rule's ``forward_methods`` (e.g. PyTorch's
``NonDynamicallyQuantizableLinear`` or a user's ``class MyLinear(nn.Linear): pass``). A subclass that
overrides ``forward`` is refused: the rule could not know what it computes.

A rule may own child modules (``owned_children``, e.g. ``MultiheadAttention.out_proj``, whose parameters
the attention rule clips itself): once the parent has been matched, its children get no rule of their own,
so no parameter is covered twice. ``named_modules`` lists a parent before its children.
"""

from __future__ import annotations

import weakref
from typing import Optional

from torch import nn

from .attention import MultiheadAttentionRule
from .base import LayerRule
from .conv import ConvRule
from .embedding import EmbeddingRule
from .hf_conv1d import HFConv1DRule
from .linear import LinearRule
from .normalization import GroupNormRule, InstanceNormRule, LayerNormRule, RMSNormRule

RULES: dict[type, LayerRule] = {}
#: (module-path prefix, class name) -> rule, for classes of libraries that may be absent
NAMED_RULES: dict[tuple[str, str], LayerRule] = {}
_OWNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def register_rule(rule: LayerRule) -> None:
    """Register ``rule`` for each of its ``module_types`` (and its subclasses, see the module docstring)."""
    for t in rule.module_types:
        RULES[t] = rule


def register_named_rule(module_prefix: str, class_name: str, rule: LayerRule) -> None:
    """Register ``rule`` for classes called ``class_name`` defined in a module under ``module_prefix``."""
    NAMED_RULES[(module_prefix, class_name)] = rule


for _rule in (LinearRule(), ConvRule(), EmbeddingRule(), LayerNormRule(), GroupNormRule(), InstanceNormRule(),
              RMSNormRule(), MultiheadAttentionRule()):
    register_rule(_rule)
register_named_rule("transformers", "Conv1D", HFConv1DRule())

_HINTS = {
    "BatchNorm": "BatchNorm mixes examples in a batch, so no per-example gradient exists; use GroupNorm or LayerNorm",
    "SyncBatchNorm": "BatchNorm mixes examples in a batch; use GroupNorm or LayerNorm",
}


def _named(cls: type) -> Optional[LayerRule]:
    for (prefix, name), rule in NAMED_RULES.items():
        if cls.__name__ == name and (cls.__module__ == prefix or cls.__module__.startswith(prefix + ".")):
            return rule
    return None


def _registered_base(cls: type) -> Optional[type]:
    """The nearest registered class in ``cls``'s method resolution order."""
    return next((b for b in cls.__mro__[1:] if b in RULES), None)


def _overridden(cls: type, base: type) -> list[str]:
    return [m for m in RULES[base].forward_methods if getattr(cls, m, None) is not getattr(base, m, None)]


def find_rule(module: nn.Module) -> Optional[LayerRule]:
    """The rule for ``module``, or ``None`` (no rule, a refused subclass, or a child its parent's rule owns)."""
    if module in _OWNED:
        return None
    cls = type(module)
    rule = RULES.get(cls) or _named(cls)
    if rule is None:
        base = _registered_base(cls)
        if base is not None and not _overridden(cls, base):
            rule = RULES[base]
    if rule is not None:
        for child in getattr(rule, "owned_children", ()):
            if isinstance(getattr(module, child, None), nn.Module):
                _OWNED.add(getattr(module, child))
    return rule


def has_registered_base(module: nn.Module) -> bool:
    """Whether ``module`` is (a subclass of) a layer with a rule, or a child a parent's rule owns: its direct
    parameters are then never treated as parameters used directly by a forward (``parameters.py``)."""
    cls = type(module)
    return module in _OWNED or cls in RULES or _named(cls) is not None or _registered_base(cls) is not None


def unsupported_reason(module: nn.Module) -> str:
    cls = type(module)
    name = cls.__name__
    for key, hint in _HINTS.items():
        if name.startswith(key):
            return hint
    rule = None if module in _OWNED else find_rule(module)
    if rule is not None:
        known = {id(p) for p in rule.params(module) if p is not None}
        extra = [n for n, p in module.named_parameters(recurse=False) if id(p) not in known]
        return (f"{name} holds parameters its per-example rule does not know ({', '.join(extra)}); register them "
                "on a separate module, or freeze them")
    base = _registered_base(cls)
    if base is not None:
        methods = ", ".join(_overridden(cls, base))
        return (f"{name} subclasses {base.__name__} but overrides {methods}, so the per-example rule for "
                f"{base.__name__} cannot know what it computes (subclasses that keep {base.__name__}'s "
                f"forward are accepted); use {base.__name__} itself, or move the extra computation into a "
                "parameter-free module around it")
    supported = ", ".join(sorted({t.__name__ for t in RULES} | {n for _, n in NAMED_RULES}))
    return f"no per-example rule for {name} (supported: {supported})"
