"""Which site covers each trainable parameter, and what the engine refuses when it attaches, before any training
(docs/design.md, *Invariants*, I5).

Each module with trainable parameters of its own gets, in this order:

0. for a layer whose weight a parametrization computes (``parametrized.py``: ``parametrize``, the hook-based
   ``weight_norm``/``spectral_norm``), its dedicated rule through the parametrization's vjp, covering the
   parametrization's parameters (the modules holding them are owned by it); without such a rule, refused;
1. its dedicated rule (``registry.find_rule``), when the rule knows every parameter of the module;
2. nothing, when a parent's rule owns it (attention's ``out_proj``);
3. per-example views (``parameters.py``), when its trainable parameters of its own all have first dimension 1
   (a class token, a position embedding) and it is no subclass of a layer with a rule (in a module with no
   trainable child, not when one of them is a ``(1,)`` scale such as ``nn.PReLU()``'s weight: step 4); next to
   trainable children, its own parameters of any shape, traced to where its forward broadcasts them over the
   batch (``broadcast.py``: ConvNeXt's layer scale, CLIP's class embedding);
4. the generic rule (``generic.py``: torch.func per example over its forward), when no child module below it
   holds a trainable parameter;
5. otherwise none: the parameters are refused, one line per module class with the reason and the fix.

Refusals name each module class once (a 32-layer model prints one line per cause, not one per parameter).
The guard on every covered parameter (I5 at run time) is installed here too.
"""

from __future__ import annotations

import inspect

from typing import Optional

import torch
from torch import nn

from .base import LayerHook, RuleDoesNotApply, UnsupportedLayerError
from .generic import GenericHook
from .parameters import ParameterHook, broadcast_candidates
from .parametrized import parametrization_modules, parametrized_hook, reparametrizations, unsupported_reason as \
    parametrized_reason
from .registry import find_rule, has_registered_base, owned_children, unsupported_reason

#: module names a refusal line lists before "and N more"
SHOWN = 3


def check_batch_mixing(module: nn.Module) -> None:
    """Refuse layers whose training forward is not per-example, trainable or not (one line per class)."""
    bad: dict[tuple[str, str], list[str]] = {}
    for name, mod in module.named_modules():
        cls = type(mod).__name__
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            why = ("its training forward normalises with statistics of the whole batch, so one example changes "
                   "every other example's gradient; use GroupNorm or LayerNorm: "
                   "model = lightning_dpzero.fix_model(model) replaces it by GroupNorm with its affine parameters")
        elif getattr(mod, "track_running_stats", False):
            why = ("track_running_stats=True keeps running statistics of the private data without noise in the "
                   "released model; construct it with track_running_stats=False (model = "
                   "lightning_dpzero.fix_model(model) does that for InstanceNorm)")
        else:
            continue
        bad.setdefault((cls, why), []).append(name or "<root>")
    if bad:
        raise UnsupportedLayerError("Differential privacy cannot be guaranteed with these layers, even frozen:\n"
                                    "  - " + "\n  - ".join(f"{cls} {_names(names)}: {why}"
                                                           for (cls, why), names in bad.items()))


def _names(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _trainable_below(mod: nn.Module) -> list[str]:
    """Names of the child modules of ``mod`` that hold trainable parameters (at any depth)."""
    return [n for n, c in mod.named_children() if any(p.requires_grad for p in c.parameters())]


def attach_hooks(engine, module: nn.Module, refused: Optional[dict[int, tuple[str, str]]] = None
                 ) -> tuple[list[LayerHook], set[int], set[int]]:
    """Replace the forward of every module that gets a site (instance attribute only); returns the hooks, the
    ids of the parameters they cover, and the ids of the child modules a parent's rule owns. ``refused`` (module
    id → (layer name, reason)) receives, for each parametrized layer no rule covers, the layer and the modules
    holding its parametrizations (for :func:`check_coverage`: one line for the layer)."""
    hooks: list[LayerHook] = []
    covered: set[int] = set()
    owned: set[int] = set()  # ids of child modules whose parent's rule clips their parameters

    def install(hook: LayerHook) -> None:
        hook.module.forward = hook
        hooks.append(hook)
        covered.update(id(p) for p in hook.rule.params(hook.module) if p is not None)

    skipped = []
    # children whose parameters their parent's forward reads without calling them (Mamba's conv1d and dt_proj):
    # the parent's site covers them with its own direct parameters (step 3); their own rule would see no call
    read_directly = {id(c): n for _, mod in module.named_modules() for n, c in children_read_directly(mod)}
    owned |= set(read_directly)
    for name, mod in module.named_modules():  # 0.-1. dedicated rules (a parent before its children)
        reparams = {} if id(mod) in owned else reparametrizations(mod)
        if reparams:  # before anything reads the computed weight (a training-mode spectral_norm updates buffers)
            hook = parametrized_hook(engine, mod, name or type(mod).__name__, reparams)
            owned |= {id(m) for m in parametrization_modules(mod)}  # never given a rule of their own
            if hook is not None:
                install(hook)
            elif refused is not None:
                reason = parametrized_reason(mod, reparams)
                refused.update({id(m): (name or "<root>", reason) for m in [mod, *parametrization_modules(mod)]})
            continue
        rule = None if id(mod) in owned else find_rule(mod)
        if rule is None:
            skipped.append((name, mod))
            continue
        owned |= {id(c) for c in owned_children(mod, rule)}
        params = [p for p in rule.params(mod) if p is not None]
        if not any(p.requires_grad for p in params):
            continue
        if {id(p) for p in mod.parameters(recurse=False)} - {id(p) for p in params}:
            skipped.append((name, mod))  # parameters the rule does not know: the generic rule, below
            continue
        try:
            rule.check(mod, name or type(mod).__name__)
        except RuleDoesNotApply:
            skipped.append((name, mod))
            continue
        install(LayerHook(engine, mod, name or type(mod).__name__, rule))
    for name, mod in skipped:  # 2.-4.
        own = [n for n, p in mod.named_parameters(recurse=False) if p.requires_grad]
        if id(mod) in owned and id(mod) not in read_directly:
            continue
        children = [f"{c}.{n}" for c, child in children_read_directly(mod)
                    for n, p in child.named_parameters(recurse=False) if p.requires_grad]
        if id(mod) in read_directly or not own + children:
            continue
        if children:  # its forward reads them: a parameter used directly, of any shape (broadcast.py)
            install(ParameterHook(engine, mod, name or "<root>", own + children))
            continue
        candidates = broadcast_candidates(mod)
        views = [n for n in candidates if id(mod._parameters[n]) not in covered]
        leaf = not _trainable_below(mod)
        # a (1,) parameter (PReLU's weight, a learned scalar gain) is a scale, not a batch-first tensor: its view
        # (B,) would not broadcast over the batch; in a module with no trainable child the generic rule clips it
        scalar = any(mod._parameters[n].dim() == 1 for n in own)
        # next to trainable children, a parameter of any shape is traced to where the forward broadcasts it
        direct = [n for n in own if id(mod._parameters[n]) not in covered] if not leaf else views
        if leaf and not has_registered_base(mod) and _input_free(mod):
            # a module whose forward takes no input (Swin's relative position bias: its table indexed and
            # reshaped) computes the same value for every example: traced to where the forward broadcasts it
            install(ParameterHook(engine, mod, name or "<root>", own, shared=True))
        elif not has_registered_base(mod) and (not leaf or set(own) <= set(candidates) and not scalar):
            if direct:
                install(ParameterHook(engine, mod, name or "<root>", direct))
        elif leaf:
            install(GenericHook(engine, mod, name or type(mod).__name__, own))
    return hooks, covered, owned


def children_read_directly(mod: nn.Module) -> list[tuple[str, nn.Module]]:
    """The child modules whose parameters ``mod``'s forward reads without calling them, as (name, child): those
    Hugging Face declares with ``@force_accelerate_hooks([...])`` on the class's forward (Mamba's mixer: ``conv1d``
    and ``dt_proj``, whose weights go to ``F.conv1d`` and a matmul; Mamba2, Jamba, FalconMamba and others alike),
    found through the ``__wrapped__`` chain of the decorators. Nothing for any other module."""
    names, f = [], getattr(type(mod), "forward", None)
    while f is not None and not names:
        code = getattr(f, "__code__", None)
        if code is not None and "child_module_names" in code.co_freevars and f.__closure__:
            value = f.__closure__[code.co_freevars.index("child_module_names")].cell_contents
            names = [value] if isinstance(value, str) else list(value)
        f = getattr(f, "__wrapped__", None)
    children = dict(mod.named_children())
    return [(n, children[n]) for n in names if n in children and isinstance(children[n], nn.Module)]


def _input_free(mod: nn.Module) -> bool:
    """``mod.forward`` takes no argument: its output cannot depend on the examples."""
    try:
        return not inspect.signature(mod.forward).parameters
    except (TypeError, ValueError):  # a forward with no signature Python can read
        return False


def has_rule_or_owner(mod: nn.Module, owned: set[int]) -> bool:
    """``mod`` is (a subclass of) a layer with a rule, or a child whose parent's rule owns it (``owned``: ids)."""
    return id(mod) in owned or has_registered_base(mod)


def _reason(mod: nn.Module, names: list[str], owned: set[int]) -> str:
    cls = type(mod).__name__
    if id(mod) in owned:
        return unsupported_reason(mod, owned=True)
    shapes = ", ".join(f"{n} of shape {tuple(mod._parameters[n].shape)}" for n in names)
    children = ", ".join(_trainable_below(mod))
    why = (f"parameters of its own ({shapes}) used by {cls}'s forward next to child modules with trainable "
           f"parameters ({children}): the generic rule (torch.func per example over a module's forward) covers a "
           "module's own parameters only when no child below it is trainable, and parameters used directly next "
           "to trainable children are traced to where the forward broadcasts them over the batch only in a module "
           f"that is not a layer with a rule ({cls} is one)")
    detail = unsupported_reason(mod)
    if has_registered_base(mod) and not detail.startswith("no per-example rule"):
        why += f"; besides, {detail}"
    return (f"{why}. Fix: move these parameters into a small module of their own (holding them and doing the "
            f"computation that uses them, called from {cls}.forward), register a rule for {cls} "
            "(lightning_dpzero.per_sample.register_rule), or freeze them (requires_grad_(False))")


def check_coverage(module: nn.Module, covered: set[int], owned: set[int],
                   refused: Optional[dict[int, tuple[str, str]]] = None) -> None:
    """Refuse, in one message with one line per module class and cause, every trainable parameter whose id is
    not in ``covered`` (``refused``: from :func:`attach_hooks`; a parametrized layer's parameters, its
    parametrizations' included, on its own line)."""
    lines: dict[tuple[str, str], list[tuple[str, list[str]]]] = {}
    by_layer: dict[str, list[str]] = {}
    classes = {name or "<root>": type(mod).__name__ for name, mod in module.named_modules()}
    for mname, mod in module.named_modules():
        names = [n for n, p in mod.named_parameters(recurse=False) if p.requires_grad and id(p) not in covered]
        if names and refused and id(mod) in refused:
            layer, reason = refused[id(mod)]
            if not by_layer.setdefault((layer, reason), []):
                lines.setdefault((classes[layer], reason), []).append((layer, by_layer[(layer, reason)]))
            below = mname[len(layer) + 1:] if layer != "<root>" else mname  # the module's path inside the layer
            by_layer[(layer, reason)].extend(f"{below}.{n}" if below else n for n in names)
        elif names:
            key = (type(mod).__name__, _reason(mod, names, owned))
            lines.setdefault(key, []).append((mname or "<root>", names))
    if not lines:
        return
    out = []
    for (cls, reason), mods in lines.items():
        first, names = mods[0]
        params = ", ".join(f"'{first + '.' if first != '<root>' else ''}{n}'" for n in names)
        more = f" and {len(mods) - 1} more {cls} modules ({_names([m for m, _ in mods[1:]])})" if len(mods) > 1 else ""
        out.append(f"{params} of {cls} '{first}'{more}: {reason}")
    raise UnsupportedLayerError(
        "Differential privacy needs a clipped per-example gradient for every trainable parameter, "
        "but these are not covered:\n  - " + "\n  - ".join(out))


# ---------------------------------------------------------------- the guard (docs/design.md, I5 at run time)
def install_guards(engine, named) -> list:
    """A hook on every covered parameter (``named``: (name, parameter)) checks, in each backward, that the
    gradient about to be accumulated is exactly what the engine's sites returned: a use of the parameter
    outside its layer (``F.linear(h, emb.weight)`` for a tied head, a class token used in ``training_step``)
    or a forward that skipped the engine (the module in ``eval()`` mode while training) would otherwise add
    an unclipped, non-private gradient silently. Returns the hook handles."""
    return [p.register_hook(_guard(engine, name, p)) for name, p in named]


def _guard(engine, name: str, p):
    def check(grad) -> None:
        if not engine.active:
            return
        emitted = engine._emitted.pop(id(p), None)
        if emitted is grad or (emitted is not None and emitted.shape == grad.shape
                               and torch.equal(emitted.to(grad.dtype), grad)):
            return
        raise UnsupportedLayerError(
            f"Parameter '{name}' received a gradient that did not pass through per-example clipping, which "
            "would make training non-private. Either it is used outside the forward of the layer that owns "
            "it (e.g. a tied output head computed as F.linear(h, embedding.weight): call the layer, or use "
            "an nn.Linear whose weight is the embedding's), or the model's forward ran without the engine "
            "(module in eval() mode or under a custom autograd path during training).")
    return check



def check_none_unfrozen(engine) -> None:
    """Refuse, at the start of a micro-batch, a parameter made trainable after the engine formed its clipping
    groups (a fine-tuning callback that unfreezes layers during fit): no group holds it, so its layer returns
    no gradient for it and it would silently never train; DeepSpeed's optimizer was also built without it."""
    groups = getattr(engine, "group_of", None)  # None: group-wise groups not given yet (set_groups)
    if groups is None:
        return
    if all(id(p) in groups for p in engine.module.parameters() if p.requires_grad):  # every micro-batch: no names
        return
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad and id(p) not in groups]
    if named:
        shown = ", ".join(f"'{n}'" for n, _ in named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
        raise UnsupportedLayerError(
            f"{len(named)} parameter(s) became trainable after differential privacy was set up at the start of fit "
            f"({shown}): the per-example clipping groups and DeepSpeed's optimizer are fixed then, so they would "
            "never receive a gradient. Set requires_grad before trainer.fit; to unfreeze in stages, run one fit "
            "per stage (resuming from the checkpoint continues the privacy ledger).")
