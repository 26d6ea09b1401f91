"""Layers whose weight is computed from other parameters: ``torch.nn.utils.parametrize`` (``parametrizations.
weight_norm`` in Wav2Vec2's positional convolution and many audio models, ``spectral_norm``, ``orthogonal``, any
user parametrization, chained or with several originals) and the older hook-based ``torch.nn.utils.weight_norm``
and ``torch.nn.utils.spectral_norm`` (docs/design.md, *The per-example engine*: parametrized layers).

Such a layer reads ``W = f(θ)``: ``θ`` are the trainable tensors of the parametrization (``weight_norm``'s
``original0 = g`` and ``original1 = v``, ``spectral_norm``'s ``original``, a parametrization module's own
parameters) and ``f`` may keep buffers (``spectral_norm``'s power-iteration vectors ``u``, ``v``). Example i's
gradient of ``θ`` is the vector-Jacobian product of ``f`` with its gradient of ``W``,

    g_θ,i = (∂W/∂θ)ᵀ g_W,i ,

a function of the parameters only (``f`` reads no example), so the layer's own rule forms ``g_W,i`` as for an
unparametrized layer (``LayerRule.per_example``: ``(B, *W.shape)``), ``torch.func.vmap`` of ``torch.func.vjp`` of
``f`` maps them to ``(B, *θ.shape)``, and the site carries those, with the layer's other parameters' (a bias),
to the engine as instantiated per-example gradients (:class:`~.generic.InstantiatedGradsRule`). Norms are taken
of ``g_θ,i``, the gradients of what the optimizer updates (a norm of ``g_W,i`` bounds nothing: ``∂W/∂v`` of
``weight_norm`` is ``g/‖v‖`` times a projection, as large as ``‖v‖`` is small). Cost per call: the layer's
per-example gradients of ``W`` instantiated (no ghost norm), ``f`` once more in backward, and the batched vjp.

``f`` is evaluated in the forward exactly as the layer would (``module.weight``: in training mode
``spectral_norm``'s power iteration updates ``u`` and ``v``, as without DP; ``parametrize.cached()`` is
honoured), and recomputed in backward with the buffers as that forward left them and the parametrization in
eval mode, so that nothing is updated twice. The power iteration reads only the weight, never an example, so
``u`` and ``v`` are functions of released parameters and the per-example gradient through ``W/σ(W; u, v)`` is
well defined. That the recomputation gives the forward's ``W`` is checked at every call (each row's sum and sum
of squares in float64): a parametrization that draws random numbers or keeps other state is refused, naming
the layer, before any gradient of the call is returned.

Under ZeRO-3 a parametrized layer is gathered as one leaf module (its originals live in a child module), so its
forward and its backward see every original gathered.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from .base import LayerHook, LayerRule, Site, UnsupportedLayerError, no_autocast
from .generic import InstantiatedGradsRule
from .registry import find_rule

#: (owner module, attribute name, tensor): where a parametrization reads a tensor it is computed from
Slot = tuple[nn.Module, str, torch.Tensor]


@contextlib.contextmanager
def _shadowed(slots: list[Slot], values) -> Iterator[None]:
    """Each slot's attribute reads the given value (set in the owner's instance dictionary, found before
    ``_parameters`` and ``_buffers``), then the owner's own again."""
    try:
        for (owner, attr, _), v in zip(slots, values):
            owner.__dict__[attr] = v
        yield
    finally:
        for owner, attr, _ in slots:
            owner.__dict__.pop(attr, None)


@contextlib.contextmanager
def _eval(module: Optional[nn.Module]) -> Iterator[None]:
    """``module`` and its children in eval mode for the block (no buffer update), then each in its own mode."""
    if module is None:
        yield
        return
    modes = [(m, m.training) for m in module.modules()]
    try:
        module.train(False)
        yield
    finally:
        for m, mode in modes:
            m.training = mode


class Reparametrization:
    """One tensor ``module.<name>`` computed by a parametrization: the trainable tensors it is computed from
    (:attr:`sources`), its buffers, and ``f`` as a function of the sources."""

    def __init__(self, module: nn.Module, name: str, sources: list[Slot], buffers: list[Slot],
                 owner: Optional[nn.Module]):
        self.module, self.name, self.sources, self.buffers = module, name, sources, buffers
        self.owner = owner  # what :meth:`function` switches to eval mode (the hook-based ones pass it a flag)
        self.names = [n for _, n, _ in sources]

    def value(self) -> torch.Tensor:
        """``W`` as the layer's forward reads it (a training-mode ``spectral_norm`` updates its buffers here)."""
        return getattr(self.module, self.name)

    def snapshot(self) -> list[torch.Tensor]:
        """The buffers as the forward left them, for the recomputation in backward."""
        return [b.detach().clone() for _, _, b in self.buffers]

    def compute(self) -> torch.Tensor:
        """``W`` from the slots as they read now (the sources and buffers shadowed by :meth:`function`)."""
        raise NotImplementedError

    def function(self, snapshot: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``f(*sources) -> W`` in eval mode with the buffers ``snapshot`` (for ``torch.func.vjp``)."""
        def f(*tensors):
            with _shadowed(self.sources, tensors), _shadowed(self.buffers, snapshot), _eval(self.owner):
                return self.compute()
        return f

    @contextlib.contextmanager
    def reads(self, w: torch.Tensor) -> Iterator[None]:
        """``module.<name>`` reads ``w`` for the block (the layer's rule reads the weight's shape)."""
        raise NotImplementedError
        yield  # pragma: no cover


class _Parametrize(Reparametrization):
    """``torch.nn.utils.parametrize``: ``module.parametrizations[name]`` (a ``ParametrizationList``) computes it
    from its originals and its parametrizations' own parameters."""

    def __init__(self, module: nn.Module, name: str):
        plist = module.parametrizations[name]

        def slots(named) -> list[Slot]:  # "0.scale" -> (plist[0], "scale", tensor)
            return [(plist.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2], t) for n, t in named]

        super().__init__(module, name, slots((n, p) for n, p in plist.named_parameters() if p.requires_grad),
                         slots(plist.named_buffers()), plist)
        self.qualified = [f"parametrizations.{name}.{n}" for n, p in plist.named_parameters() if p.requires_grad]

    def compute(self) -> torch.Tensor:
        return self.owner()

    @contextlib.contextmanager
    def reads(self, w):
        # the property computes ``parametrizations[name]()``: its forward, an instance attribute for the block
        self.owner.__dict__["forward"] = lambda: w
        try:
            yield
        finally:
            self.owner.__dict__.pop("forward", None)


class _WeightHook(Reparametrization):
    """The hook-based ``torch.nn.utils.weight_norm`` / ``spectral_norm``: a forward pre-hook sets ``module.<name>``
    from ``<name>_g``/``<name>_v`` (or ``<name>_orig`` with buffers ``<name>_u``/``<name>_v``)."""

    def __init__(self, module: nn.Module, hook: Any, spectral: bool):
        name = hook.name
        own = dict(module.named_parameters(recurse=False))
        params = [f"{name}_orig"] if spectral else [f"{name}_g", f"{name}_v"]
        buffers = [f"{name}_u", f"{name}_v"] if spectral else []
        super().__init__(module, name, [(module, n, own[n]) for n in params if own[n].requires_grad],
                         [(module, n, module._buffers[n]) for n in buffers], None)
        self.hook, self.spectral = hook, spectral
        self.qualified = list(self.names)

    def value(self):
        return self.module.__dict__[self.name]  # set by the pre-hook, which ran before the layer's forward

    def compute(self):
        if self.spectral:
            return self.hook.compute_weight(self.module, do_power_iteration=False)
        return self.hook.compute_weight(self.module)

    @contextlib.contextmanager
    def reads(self, w):
        before = self.module.__dict__.get(self.name)
        self.module.__dict__[self.name] = w
        try:
            yield
        finally:
            self.module.__dict__[self.name] = before


def reparametrizations(module: nn.Module) -> dict[str, Reparametrization]:
    """The tensors of ``module`` (by attribute name) that a parametrization computes, with a trainable source."""
    found: dict[str, Reparametrization] = {}
    if parametrize.is_parametrized(module):
        for name in module.parametrizations.keys():
            found[name] = _Parametrize(module, name)
    hooks = _weight_hooks(module)
    for hook, spectral in hooks:
        found[hook.name] = _WeightHook(module, hook, spectral)
    return {n: r for n, r in found.items() if r.sources}


def _weight_hooks(module: nn.Module) -> list[tuple[Any, bool]]:
    """The hook-based weight_norm / spectral_norm pre-hooks of ``module`` (the modules are imported only if loaded)."""
    norm = sys.modules.get("torch.nn.utils.weight_norm")
    spectral = sys.modules.get("torch.nn.utils.spectral_norm")
    out = []
    for hook in module._forward_pre_hooks.values():
        if norm is not None and isinstance(hook, norm.WeightNorm):
            out.append((hook, False))
        elif spectral is not None and isinstance(hook, spectral.SpectralNorm):
            out.append((hook, True))
    return out


def parametrization_modules(module: nn.Module) -> list[nn.Module]:
    """The modules below ``module`` that hold its parametrizations (their parameters are ``module``'s sources)."""
    return list(module.parametrizations.modules()) if parametrize.is_parametrized(module) else []


def unsupported_reason(module: nn.Module, reparams: dict[str, Reparametrization]) -> str:
    """Why a parametrized ``module`` is refused: its layer has no dedicated single-input rule."""
    cls = type(module)
    base = cls.__mro__[1].__name__ if parametrize.is_parametrized(module) else cls.__name__
    names = ", ".join(f"'{n}'" for n in reparams)
    return (f"{base}'s {names} is computed by a parametrization (torch.nn.utils.parametrize or the hook-based "
            f"weight_norm/spectral_norm), which is supported on layers with a dedicated single-input per-example "
            f"rule (nn.Linear, nn.Conv1d/2d/3d, nn.Embedding, ...), and {base} has none. Fix: parametrize a "
            "supported layer inside it, register a rule for it (lightning_dpzero.per_sample.register_rule), or "
            "freeze the parametrization's parameters (requires_grad_(False))")


def parametrized_hook(engine, module: nn.Module, name: str, reparams: dict[str, Reparametrization]
                      ) -> Optional["ParametrizedHook"]:
    """The hook of a parametrized layer whose class (below ``Parametrized…``) has a dedicated single-input rule
    knowing every tensor of it; ``None`` otherwise (refused by the coverage check with
    :func:`unsupported_reason`)."""
    inner = find_rule(module)
    if inner is None or inner.multi_input or inner.owned_children:
        return None
    known = set(inner.param_names)
    if set(reparams) - known:
        return None
    sources = {id(p) for r in reparams.values() for _, _, p in r.sources}
    own = {n for n, p in module.named_parameters(recurse=False) if p.requires_grad and id(p) not in sources}
    if own - known:
        return None
    return ParametrizedHook(engine, module, name, inner, reparams)


class ParametrizedRule(InstantiatedGradsRule):
    """The site of a parametrized layer: per-example gradients of the parametrizations' sources and of the
    layer's other parameters, formed by :class:`ParametrizedFunction` with the layer's own rule ``inner``.
    Input checks (batch size, layout) are ``inner``'s."""

    def __init__(self, inner: LayerRule, module: nn.Module, reparams: dict[str, Reparametrization]):
        names, params, self.layer_slots = [], [], []
        for n in inner.param_names:
            if n in reparams:
                r = reparams[n]
                self.layer_slots.append((n, r, [len(params) + k for k in range(len(r.sources))]))
                names += r.qualified
                params += [p for _, _, p in r.sources]
            else:
                p = module._parameters.get(n)
                trainable = isinstance(p, nn.Parameter) and p.requires_grad
                self.layer_slots.append((n, None, [len(params)] if trainable else []))
                if trainable:
                    names.append(n)
                    params.append(p)
        super().__init__(names, params)
        self.inner, self.reparams = inner, reparams
        self.min_input_dim, self.broadcast_batch = inner.min_input_dim, inner.broadcast_batch

    def check(self, module, name):
        self.inner.check(module, name)

    def batch_size(self, module, x, extra=((), {})):
        return self.inner.batch_size(module, x, extra)

    def layout_inputs(self, module, args, kwargs):
        return self.inner.layout_inputs(module, args, kwargs)

    @contextlib.contextmanager
    def reading(self, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
        """The layer's parametrized attributes read ``tensors`` for the block."""
        with contextlib.ExitStack() as stack:
            for n, w in tensors.items():
                stack.enter_context(self.reparams[n].reads(w))
            yield


class ParametrizedHook(LayerHook):
    """Wraps the parametrized layer's forward (an instance attribute) like any attached layer; its calls run
    through :class:`ParametrizedFunction`."""

    def __init__(self, engine, module: nn.Module, name: str, inner: LayerRule, reparams: dict[str, Reparametrization]):
        super().__init__(engine, module, name, ParametrizedRule(inner, module, reparams))
        # parametrize keeps the originals in a child module: ZeRO-3 gathers the layer whole, forward and backward
        self.zero3_leaf = any(True for _ in module.children())
        from ..util.known_warnings import filter_known_warnings

        filter_known_warnings()  # torch.func's notice of its exact per-example fallback for weight_norm's backward

    def run(self, x, params, extra):
        return ParametrizedFunction.apply(self, x, *params)

    def refusal(self, what: str) -> UnsupportedLayerError:
        names = ", ".join(f"'{n}'" for n in self.rule.reparams)
        return UnsupportedLayerError(
            f"{type(self.module).__name__} '{self.name}': {what}, so the per-example gradients of the parameters its "
            f"{names} is computed from cannot be formed. Fix: use a parametrization that computes the same tensor "
            "from the same parameters and buffers every time, or freeze its parameters (requires_grad_(False)).")


def _fingerprint(w: torch.Tensor) -> torch.Tensor:
    """Each row's sum and sum of squares in float64: what the recomputation in backward must reproduce."""
    rows = w.detach().double().reshape(w.shape[0], -1) if w.dim() else w.detach().double().reshape(1, 1)
    return torch.stack([rows.sum(1), rows.pow(2).sum(1)])


def _same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2
    return a.shape == b.shape and torch.allclose(a, b, rtol=tol, atol=tol * float(b.abs().max()) + 1e-12)


class ParametrizedFunction(torch.autograd.Function):
    """``out = inner.forward(module, x, W, …)`` with ``W = f(θ)``; backward returns the input gradient and the
    engine's clipped gradients of ``θ`` and the layer's other parameters. Inputs: ``(hook, x, *params)``."""

    @staticmethod
    def forward(ctx, hook, x, *params):
        rule, module = hook.rule, hook.module
        computed = {n: r.value().detach() for n, r in rule.reparams.items()}
        ctx.snapshots = {n: r.snapshot() for n, r in rule.reparams.items()}
        ctx.prints = {n: _fingerprint(w) for n, w in computed.items()}
        layer = [computed[n] if r is not None else (params[k[0]] if k else getattr(module, n, None))
                 for n, r, k in rule.layer_slots]
        with rule.reading(computed):
            out, reuse = rule.inner.forward_saving(module, x, *layer)
        ctx.hook = hook
        ctx.save_for_backward(x, *params, *reuse)
        ctx.n = len(params)
        return out

    @staticmethod
    def backward(ctx, g):
        hook = ctx.hook
        rule, module = hook.rule, hook.module
        saved = list(ctx.saved_tensors)
        x, params, reuse = saved[0], saved[1:1 + ctx.n], saved[1 + ctx.n:]
        with no_autocast(), torch.enable_grad():
            computed, vjps = {}, {}
            for n, r in rule.reparams.items():
                k = next(k for m, _, k in rule.layer_slots if m == n)
                sources = [params[i].detach().float() for i in k]
                w, vjps[n] = torch.func.vjp(r.function(ctx.snapshots[n]), *sources)
                if not _same(_fingerprint(w), ctx.prints[n], params[k[0]].dtype):
                    raise hook.refusal(f"its parametrization of '{n}' gave another tensor when recomputed in backward "
                                       "(in eval mode, from the buffers its forward left) than in the forward: it "
                                       "draws random numbers or keeps state other than its buffers")
                computed[n] = w.detach().to(params[k[0]].dtype)
        layer = [computed[n] if r is not None else (params[k[0]] if k else getattr(module, n, None))
                 for n, r, k in rule.layer_slots]
        site = Site(hook, x, g)
        if reuse:
            site.kept["forward"] = tuple(reuse)
        mask = [bool(k) for _, _, k in rule.layer_slots]
        with no_autocast(), rule.reading(computed):
            gx = rule.inner.grad_input(site, layer) if ctx.needs_input_grad[1] else None
            per = rule.inner.per_example(site, mask) if not hook.engine.stand_in else None
        b = x.shape[0] if hasattr(x, "shape") else len(x)
        grads: list[Optional[torch.Tensor]] = [None] * ctx.n
        if per is not None:
            for (n, r, k), pe in zip(rule.layer_slots, per):
                if not k:
                    continue
                if r is None:
                    grads[k[0]] = pe.float()
                else:
                    for i, t in zip(k, _batched_vjp(vjps[n], pe.float())):
                        grads[i] = t
        out = Site(hook, torch.empty(b, 0, device=g.device), tuple(grads))
        return (None, gx, *hook.engine._on_backward(out, list(params)))


def _batched_vjp(vjp: Callable, cotangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``vjp`` of each row of ``cotangents`` (B, *W.shape), stacked: ``(B, *θ.shape)`` per source. One
    ``torch.func.vmap``; a parametrization whose backward has no batching rule runs one row at a time (exact,
    slower)."""
    if cotangents.shape[0] == 0:
        return tuple(t.unsqueeze(0)[:0] for t in vjp(cotangents.new_zeros(cotangents.shape[1:])))
    try:
        return torch.func.vmap(vjp)(cotangents)
    except RuntimeError:
        rows = [vjp(c) for c in cotangents]
        return tuple(torch.stack(parts) for parts in zip(*rows))
