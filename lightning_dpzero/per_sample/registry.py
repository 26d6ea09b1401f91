"""Which rule handles which module: the matching. Each rule registers itself where it is defined, with the
:func:`register_rule` class decorator (as Opacus registers its grad samplers); the package's ``__init__``
imports the built-in rule modules so that they do.

A module is matched, in order, by its exact type, by its class name and module path (layers of optional
libraries, e.g. HuggingFace's ``Conv1D``, so that ``transformers`` is never imported here), then as a
subclass of a registered type that overrides none of the rule's ``forward_methods`` (e.g. PyTorch's
``NonDynamicallyQuantizableLinear`` or a user's ``class MyLinear(nn.Linear): pass``). A subclass that
overrides ``forward`` is refused: the rule could not know what it computes.

Matching is pure: which child modules a parent's rule owns (``LayerRule.owned_children``, e.g.
``MultiheadAttention.out_proj``) is worked out by the engine when it attaches (:func:`owned_children`).
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar, Union

from torch import nn

from .base import LayerRule

RULES: dict[type, LayerRule] = {}
#: (module-path prefix, class name) -> rule, for classes of libraries that may be absent
NAMED_RULES: dict[tuple[str, str], LayerRule] = {}

R = TypeVar("R", bound=type)


def register_rule(*layers: Union[type, str]) -> Callable[[R], R]:
    """Class decorator: one instance of the decorated :class:`~lightning_dpzero.per_sample.LayerRule`
    subclass handles every module of the given layer classes, and their subclasses that override none of
    the rule's ``forward_methods``. Register before the strategy (or engine) attaches to the model; a later
    registration for the same class replaces the earlier one.

    Args:
        *layers: ``nn.Module`` subclasses, or names ``"package.ClassName"`` matching a class called
            ``ClassName`` defined in ``package`` or any of its submodules, without importing it (HuggingFace's
            ``"transformers.Conv1D"``).

    Raises:
        TypeError: no layer, a layer that is neither an ``nn.Module`` subclass nor such a name, or a decorated
            class that is not a ``LayerRule`` subclass constructible without arguments.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from lightning_dpzero.per_sample import LayerRule, register_rule
        >>> class Shift(nn.Module):  # y = x + bias
        ...     def __init__(self, d):
        ...         super().__init__()
        ...         self.bias = nn.Parameter(torch.zeros(d))
        ...     def forward(self, x):
        ...         return x + self.bias
        >>> @register_rule(Shift)
        ... class ShiftRule(LayerRule):
        ...     param_names = ("bias",)
        ...     def forward(self, module, x, bias):
        ...         return x + bias
        ...     def grad_input(self, site, params):
        ...         return site.g
        ...     def per_example(self, site, mask):  # (B, d): g summed over the positions of each example
        ...         return [site.g.float().reshape(site.g.shape[0], -1, site.g.shape[-1]).sum(1)]
        ...     def norm_sq(self, site, mask):
        ...         return [self.per_example(site, mask)[0].pow(2).sum(1)]
        ...     def clipped_grads(self, site, coef, mask):
        ...         return [(coef.view(-1, 1) * self.per_example(site, mask)[0]).sum(0).to(site.g.dtype)]
        >>> ShiftRule.module_types == (Shift,)
        True
    """
    if not layers:
        raise TypeError("register_rule needs the layer classes (or 'package.ClassName' names) the rule handles.")
    for layer in layers:
        if not (isinstance(layer, type) and issubclass(layer, nn.Module)
                or isinstance(layer, str) and "." in layer.strip(".")):
            raise TypeError(f"register_rule: {layer!r} is neither an nn.Module subclass nor a 'package.ClassName' "
                            "name.")

    def decorate(cls: R) -> R:
        if not (isinstance(cls, type) and issubclass(cls, LayerRule)):
            raise TypeError(f"@register_rule decorates a LayerRule subclass, not {cls!r}.")
        rule = cls()
        cls.module_types = tuple(layers)
        for layer in layers:
            if isinstance(layer, str):
                prefix, _, name = layer.rpartition(".")
                NAMED_RULES[(prefix, name)] = rule
            else:
                RULES[layer] = rule
        return cls

    return decorate


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
    """The rule for ``module``, or ``None`` (no rule, or a subclass that overrides the layer's forward)."""
    cls = type(module)
    rule = RULES.get(cls) or _named(cls)
    if rule is None:
        base = _registered_base(cls)
        if base is not None and not _overridden(cls, base):
            rule = RULES[base]
    return rule


def owned_children(module: nn.Module, rule: LayerRule) -> list[nn.Module]:
    """The child modules of ``module`` whose parameters ``rule`` clips itself (``rule.owned_children``)."""
    return [c for c in (getattr(module, n, None) for n in rule.owned_children) if isinstance(c, nn.Module)]


def has_registered_base(module: nn.Module) -> bool:
    """Whether ``module`` is (a subclass of) a layer with a rule: its direct parameters are then never treated
    as parameters used directly by a forward (``parameters.py``)."""
    cls = type(module)
    return cls in RULES or _named(cls) is not None or _registered_base(cls) is not None


def unsupported_reason(module: nn.Module, owned: bool = False) -> str:
    """Why ``module``'s parameters get no rule (``owned``: a parent's rule owns the module), for the refusal."""
    cls = type(module)
    name = cls.__name__
    for key, hint in _HINTS.items():
        if name.startswith(key):
            return hint
    if owned:
        return (f"the rule of the layer that owns this {name} clips its parameters, but was not applied to that "
                "layer (see the layer's own entry)")
    rule = find_rule(module)
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
