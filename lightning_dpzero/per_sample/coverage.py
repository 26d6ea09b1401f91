"""What the engine refuses when it attaches, before any training (docs/design.md, *Invariants*, I5): layers
whose training forward is not per-example, and trainable parameters that no rule covers, each named with the
reason and the fix."""

from __future__ import annotations

from torch import nn

from .base import UnsupportedLayerError
from .registry import has_registered_base, unsupported_reason


def check_batch_mixing(module: nn.Module) -> None:
    """Refuse layers whose training forward is not per-example, trainable or not."""
    bad = []
    for name, mod in module.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            bad.append(f"{type(mod).__name__} '{name}': its training forward normalises with statistics of the "
                       "whole batch, so one example changes every other example's gradient; use GroupNorm or "
                       "LayerNorm")
        elif getattr(mod, "track_running_stats", False):
            bad.append(f"{type(mod).__name__} '{name}': track_running_stats=True keeps running statistics of the "
                       "private data without noise in the released model; construct it with "
                       "track_running_stats=False")
    if bad:
        raise UnsupportedLayerError("Differential privacy cannot be guaranteed with these layers, even frozen:\n"
                                    "  - " + "\n  - ".join(bad))


def has_rule_or_owner(mod: nn.Module, owned: set[int]) -> bool:
    """``mod`` is (a subclass of) a layer with a rule, or a child whose parent's rule owns it (``owned``: ids):
    its direct parameters are never treated as parameters used directly by a forward (``parameters.py``)."""
    return id(mod) in owned or has_registered_base(mod)


def check_coverage(module: nn.Module, covered: set[int], owned: set[int]) -> None:
    """Refuse, in one message with one line per cause, every trainable parameter whose id is not in
    ``covered``."""
    missing = []
    for mname, mod in module.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in covered:
                full = f"{mname}.{pname}" if mname else pname
                reason = unsupported_reason(mod, owned=id(mod) in owned)
                if not has_rule_or_owner(mod, owned):
                    reason = (f"a parameter of shape {tuple(p.shape)} used directly by {type(mod).__name__}'s "
                              "forward; such a parameter is supported only when its first dimension is 1 and "
                              "the forward broadcasts it over the batch (a class token (1, 1, d), a position "
                              "embedding (1, T, d)). Otherwise put it in a supported layer. " + reason)
                missing.append(f"'{full}' of {type(mod).__name__} '{mname or '<root>'}': {reason}")
    if missing:
        raise UnsupportedLayerError(
            "Differential privacy needs a clipped per-example gradient for every trainable parameter, "
            "but these are not covered:\n  - " + "\n  - ".join(dict.fromkeys(missing))
            + "\nFix: replace the layer with a supported one (e.g. BatchNorm -> GroupNorm/LayerNorm), or "
            "freeze the parameter with requires_grad=False."
        )
