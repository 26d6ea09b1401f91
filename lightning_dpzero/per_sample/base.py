"""Layer rules, the per-call site they work on, and the autograd functions that let a layer emit its own
clipped weight gradient.

A *rule* (:class:`LayerRule`) knows one layer family (``nn.Linear``, ``nn.Conv2d``, ...): the plain forward,
the input gradient, the per-example squared gradient norms of its trainable parameters, and the sum of the
per-example gradients weighted by clipping coefficients. One instance serves every layer of its family in
every engine, so it holds no state of a call: what one call needs between its backward's steps lives on
the :class:`Site` the engine hands to each method. ``PerSampleFunction`` runs the forward and, in backward,
asks the engine what to return for the parameters, so DeepSpeed's own gradient hooks see the *clipped*
gradient (docs/design.md, *Where each piece runs*: DeepSpeed is never patched).

Shapes: ``site.x`` is the layer input with the batch first, ``(B, ...)``; ``site.g`` is the gradient of the
(scaled) loss with respect to the layer output, ``(B, ...)``.

Layers called with several tensors and options (attention: ``mha(q, k, v, key_padding_mask=...)``) set
:attr:`LayerRule.multi_input`: :func:`run_call` hands the rule's :meth:`~LayerRule.bind` result to
:class:`MultiInputFunction`, whose backward asks the rule for the input gradients *and* what its norms need
in one go (:meth:`~LayerRule.backward_multi`). ``site.x`` and ``site.g`` are then whatever the rule records
(an :class:`Inputs` for ``x``, whose ``shape[0]`` is the batch size).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Optional

import torch
from torch import nn


class Site:
    """One call of an attached layer, as its backward sees it: created by the autograd function's backward,
    handed to the rule's :meth:`~LayerRule.grad_input`, :meth:`~LayerRule.norm_sq`,
    :meth:`~LayerRule.per_example` and :meth:`~LayerRule.clipped_grads`, held by the engine until the
    clipped sums of its groups are formed, then dropped (at the latest when the backward pass ends). Two
    calls, two engines or two threads never share one."""

    __slots__ = ("hook", "x", "g", "dtype", "scale", "completes", "path", "kept", "units", "__weakref__")

    def __init__(self, hook: "LayerHook", x: Any, g: Any):
        self.hook = hook
        """The attached layer (``hook.module``, ``hook.name``) this call belongs to."""
        self.x = x
        """The layer's input, batch first (for a multi-input rule, what its ``backward_multi`` records)."""
        self.g = g
        """The gradient of the loss with respect to the layer's output, batch first (for a multi-input rule,
        what its ``backward_multi`` records)."""
        self.dtype: Optional[torch.dtype] = getattr(g, "dtype", None)
        """``g``'s dtype, the clipped sums' (``None`` for a multi-input rule's records); kept after
        :meth:`release_rows`."""
        self.scale = 1.0
        """Set by the engine: ``g`` × ``scale`` is the gradient of each example's own loss."""
        self.completes = False
        """Set by the engine before ``norm_sq``: every group of this site completes here and is returned from
        here (layer-wise), so ``clipped_grads`` follows at once; otherwise it may come at the end of the
        backward pass (``paths.may_keep`` decides what may be kept until then)."""
        self.path: Optional[str] = None
        """The path the rule took for the weight gradient (``"ghost"``, ``"instantiate"``, ``"reuse"``) or
        ``None``; the engine publishes it in ``PerSampleEngine.last_paths``."""
        self.units = None
        """Set by the engine for a site clipped by privacy units row by row (``units.py``): its clipped sums take
        each row's coefficient c_u / n_u; ``None`` otherwise."""
        self.kept: dict[str, Any] = {}
        """What the rule keeps between its methods for this call (per-example tensors its norm formed, for
        the clipped sum; a normalisation its input gradient computed): private to the rule."""

    @property
    def module(self) -> nn.Module:
        """The layer (``hook.module``)."""
        return self.hook.module

    def release_rows(self) -> None:
        """Drop ``x`` and ``g`` (the engine calls it where the rule's :meth:`~LayerRule.releases_rows` says
        ``kept`` forms every clipped sum of the site): a site waiting for its group no longer holds them."""
        self.x = self.g = None


class LayerRule:
    """Per-example machinery for one layer family, registered with ``@register_rule(...)`` in its own file.

    Every attribute a rule may set is declared here with its default; the engine reads them as they are.
    The methods get the call's :class:`Site` and keep nothing on ``self``: a rule instance is shared by
    every layer of its family in every engine.
    """

    module_types: tuple = ()
    """Set by ``register_rule``: the layer classes (and ``"package.ClassName"`` names) the rule is
    registered for. A subclass of a registered class is accepted when it overrides none of
    ``forward_methods``."""
    forward_methods: tuple[str, ...] = ("forward",)
    """Methods whose override by a subclass changes what the layer computes (the subclass is then refused)."""
    param_names: tuple[str, ...] = ("weight", "bias")
    """Names of the parameters the rule covers, in the order passed to the autograd function and of every
    ``mask`` and returned list; an absent one (``bias=False``) is ``None``."""
    scales_sums: bool = False
    """:meth:`clipped_grads` takes a fourth argument ``alpha``, a constant its product applies to the sums without a
    kernel of its own (``clip_coefficients_sq(factored=True)``); others get the coefficients multiplied by it."""
    multi_input: bool = False
    """The layer is called with several tensors and options (attention: ``mha(q, k, v, key_padding_mask=...)``):
    the rule implements :meth:`bind` and :meth:`backward_multi`; single-input rules leave it False."""
    owned_children: tuple[str, ...] = ()
    """Child modules whose parameters this rule clips itself because the layer reads them without calling
    them (``MultiheadAttention.out_proj``): the engine gives them no rule of their own, and under ZeRO-3 the
    layer must be a leaf module (``PerSampleEngine.zero3_leaf_types``)."""
    min_input_dim: int = 1
    """The fewest dimensions of the input; fewer is refused at the forward (Embedding: 2, so that a ``(T,)``
    index, whose length could equal the batch size by chance, is not taken for T examples)."""
    rows_independent: bool = False
    """The layer computes each row of its input (along every leading dimension) from that row alone, so an input
    of the examples' tokens as rows, ``(B·m, ...)``, may be handed to it as ``(B, m, ...)`` (``token_major.py``):
    Linear, LayerNorm, RMSNorm, Embedding. A convolution or attention mixes rows and leaves it ``False``."""
    broadcast_batch: bool = False
    """An input with batch dimension 1 in a larger micro-batch (position ids ``(1, T)``) is expanded to the
    batch, so each example gets its own copy and its own gradient; otherwise it is refused."""

    def check(self, module: nn.Module, name: str) -> None:
        """Raise ``UnsupportedLayerError`` for configurations the rule cannot clip (before training)."""

    def batch_size(self, module: nn.Module, x: Any, extra: tuple[tuple, dict] = ((), {})
                   ) -> Optional[tuple[int, Optional[int]]]:
        """The number of examples in one call ``module(x, *args, **kwargs)`` (``extra`` = (args, kwargs)) and the
        dimension of ``x`` that holds them, which the engine checks against the micro-batch size before the
        call runs; ``None`` when ``x`` has no batch dimension (refused). Default: ``x.shape[0]``, dimension 0.
        An RNN with ``batch_first=False`` answers dimension 1; a count that is no dimension of ``x`` (an
        ``EmbeddingBag``'s number of bags, given by its offsets; a ``PackedSequence``'s first batch size)
        answers dimension ``None``. May raise ``UnsupportedLayerError`` for an input the rule refuses."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            return None
        return x.shape[0], 0

    def layout_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> list:
        """The tensor arguments of one call ``module(*args, **kwargs)`` as the layout check compares them
        (``layout.py``): each either a tensor whose first dimension is the batch (or that no example owns: a
        mask), or a list of B tensors, example i's part of a ragged input. Default: every tensor of ``args``
        and ``kwargs`` as given. An RNN answers its input batch first (a ``PackedSequence`` as its B
        sequences in the batch's order) and its initial state batch first; an ``EmbeddingBag`` given offsets
        answers its bags."""
        from torch.utils._pytree import tree_flatten

        return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() >= 1]

    def params(self, module: nn.Module) -> list[Optional[torch.Tensor]]:
        """The module's parameters in ``param_names`` order (``None`` for an absent one)."""
        return [getattr(module, n, None) for n in self.param_names]

    def forward(self, module: nn.Module, x: torch.Tensor, *params: Optional[torch.Tensor]) -> torch.Tensor:
        """The layer's output for input ``x`` and the given parameters (the module's own forward)."""
        raise NotImplementedError

    def forward_saving(self, module: nn.Module, x: torch.Tensor, *params: Optional[torch.Tensor]
                       ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """:meth:`forward` and what its backward may reuse instead of recomputing (a normalisation's mean and
        reciprocal std): the autograd function saves those tensors with the input and hands them to the rule
        as ``site.kept["forward"]``. Default: the plain forward, nothing saved."""
        return self.forward(module, x, *params), ()

    def grad_input(self, site: Site, params: list[Optional[torch.Tensor]]) -> torch.Tensor:
        """Gradient with respect to ``site.x``; the default recomputes the forward under autograd."""
        with torch.enable_grad():
            x_ = site.x.detach().requires_grad_(True)
            out = self.forward(site.module, x_, *[p.detach() if p is not None else None for p in params])
            (gx,) = torch.autograd.grad(out, x_, site.g)
        return gx

    def norm_sq(self, site: Site, mask: list[bool]) -> list[Optional[torch.Tensor]]:
        """Per parameter (``None`` where ``mask`` is False): per-example squared gradient norms, ``(B,)`` fp32."""
        raise NotImplementedError

    def per_example(self, site: Site, mask: list[bool]) -> list[Optional[torch.Tensor]]:
        """Per parameter: the instantiated per-example gradients ``(B, *param.shape)`` fp32 (for parameters
        shared by several call sites, whose norm needs the sum of the sites' contributions)."""
        raise NotImplementedError

    def releases_rows(self, site: Site) -> bool:
        """Whether what this call kept on ``site`` (after :meth:`norm_sq`) forms every clipped sum it will be
        asked for, without ``site.x`` or ``site.g``: the engine then drops them while the site waits for its
        group (all-layer and group-wise book-keeping keep sites until the end of the backward pass), where the
        site's parameters are in one group. Default: ``False``."""
        return False

    def clipped_grads(self, site: Site, coef: torch.Tensor, mask: list[bool]) -> list[Optional[torch.Tensor]]:
        """Per parameter: ``Σ_i coef_i · g_i`` (``None`` where ``mask`` is False), in ``site.g``'s dtype."""
        raise NotImplementedError

    def add_clipped_grads(self, site: Site, coef: torch.Tensor, mask: list[bool],
                          into: list[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
        """:meth:`clipped_grads` for a deferred write: where ``into`` has a tensor (the parameter's ``p.grad``,
        full shape, contiguous, in ``site.g``'s dtype) the rule may add its sum into it in place and answer
        ``None`` for it; every other sum is returned for the engine to write. Default: nothing in place."""
        return self.clipped_grads(site, coef, mask)

    # ---- multi-input rules only (``multi_input = True``)
    def bind(self, module, x, args: tuple, kwargs: dict) -> tuple[tuple[torch.Tensor, ...], dict]:
        """Split one call ``module(x, *args, **kwargs)`` into its differentiable tensors (batch first, ``x``
        first) and a fresh dict of everything else; ``forward`` may add to it what backward needs."""
        raise NotImplementedError

    def backward_multi(self, module, inputs: "Inputs", params, grads: tuple, needs_input_grad: tuple
                       ) -> tuple[list[Optional[torch.Tensor]], Any, Any]:
        """Gradients for ``inputs`` (``None`` where not needed) and the ``(x, g)`` records that the call's
        :class:`Site` carries to ``norm_sq``/``per_example``/``clipped_grads``; ``grads`` has one entry per
        output, ``None`` for an unused output."""
        raise NotImplementedError

    def assemble(self, module, outputs: Any, options: dict) -> Any:
        """What the layer's call returns, built from the autograd function's tensor outputs (``forward``'s) and
        ``bind``'s options: for layers whose result is not a flat tuple of tensors (an RNN's
        ``(PackedSequence, (h_n, c_n))``). Default: the outputs as they are."""
        return outputs


class UnsupportedLayerError(RuntimeError):
    """A trainable parameter would not receive a clipped per-example gradient (docs/design.md, I5)."""


class RuleDoesNotApply(UnsupportedLayerError):
    """Raised by :meth:`LayerRule.check` for a module that its registration matched (by class name) but whose
    forward the rule does not compute: the engine gives the module the generic rule instead (coverage.py)."""


class Inputs(tuple):
    """The tensors of one call of a multi-input layer (batch first) and its other arguments ``options``.
    ``shape`` is the first tensor's: the engine reads the batch size from ``shape[0]``."""

    def __new__(cls, tensors, options: Optional[dict] = None):
        self = super().__new__(cls, tensors)
        self.options = {} if options is None else options
        return self

    @property
    def shape(self) -> torch.Size:
        return self[0].shape


class PerSampleFunction(torch.autograd.Function):
    """``out = rule.forward(module, x, *params)``; backward returns the engine's clipped parameter gradients.

    The parameters are inputs of the function, so autograd accumulates what backward returns into
    ``param.grad`` and DeepSpeed's reduce hooks fire on it as on any gradient.
    """

    @staticmethod
    def forward(ctx, hook, x, *params):
        ctx.hook = hook
        ctx.has_params = [p is not None for p in params]
        out, reuse = hook.rule.forward_saving(hook.module, x, *params)
        ctx.save_for_backward(x, *[p for p in params if p is not None], *reuse)
        return out

    @staticmethod
    def backward(ctx, g):
        hook = ctx.hook
        saved = list(ctx.saved_tensors)
        x = saved.pop(0)
        params = [saved.pop(0) if has else None for has in ctx.has_params]
        site = Site(hook, x, g)
        if saved:  # what the rule's forward_saving kept for this call
            site.kept["forward"] = tuple(saved)
        with no_autocast():
            gx = hook.rule.grad_input(site, params) if ctx.needs_input_grad[1] else None
            return (None, gx, *hook.engine._on_backward(site, params))


class MultiInputFunction(torch.autograd.Function):
    """``PerSampleFunction`` for a multi-input rule: inputs ``(hook, options, n, *tensors[n], *params)``;
    the outputs are ``rule.forward``'s (a tuple may hold ``None``), their gradients may be ``None``."""

    @staticmethod
    def forward(ctx, hook, options, n, *args):
        ctx.hook, ctx.options, ctx.n = hook, options, n
        params = args[n:]
        ctx.has_params = [p is not None for p in params]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*args[:n], *[p for p in params if p is not None])
        return hook.rule.forward(hook.module, Inputs(args[:n], options), *params)

    @staticmethod
    def backward(ctx, *grads):
        hook, n = ctx.hook, ctx.n
        saved = list(ctx.saved_tensors)
        inputs = Inputs(saved[:n], ctx.options)
        rest = saved[n:]
        params = [rest.pop(0) if has else None for has in ctx.has_params]
        with no_autocast():
            gin, x, g = hook.rule.backward_multi(hook.module, inputs, params, grads, ctx.needs_input_grad[3:3 + n])
            return (None, None, None, *gin, *hook.engine._on_backward(Site(hook, x, g), params))


def _autocast_devices() -> tuple[str, ...]:
    """The device types this PyTorch's autocast knows (asking about another raises)."""
    known = []
    for device in ("cpu", "cuda", "xpu", "mps", "hpu"):
        try:
            torch.is_autocast_enabled(device)
        except (RuntimeError, ValueError):
            continue
        known.append(device)
    return tuple(known)


_AUTOCAST_DEVICES = _autocast_devices()


def no_autocast() -> contextlib.AbstractContextManager:
    """The engine's backward work (the rules' backward, the deferred clipped sums) runs outside autocast even
    when the user's ``backward()`` call is inside it, which PyTorch advises against and which would then apply to
    every op a custom backward calls: norms and coefficients would be formed in 16-bit, and an autocast policy
    applied to a rule's padding or recomputation would mix dtypes. The rules cast explicitly. (Entered once per
    site: where no autocast is on, the usual case, it is an empty context.)"""
    enabled = [device for device in _AUTOCAST_DEVICES if torch.is_autocast_enabled(device)]
    if not enabled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for device in enabled:
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def run_call(hook: "LayerHook", x: torch.Tensor, params: list, extra: tuple[tuple, dict]):
    """One clipped call of an attached layer: through :class:`PerSampleFunction`, or for a multi-input rule
    through :class:`MultiInputFunction` with the call's other arguments ``extra`` (args, kwargs) bound."""
    if not hook.rule.multi_input:
        return PerSampleFunction.apply(hook, x, *params)
    tensors, options = hook.rule.bind(hook.module, x, *extra)
    out = MultiInputFunction.apply(hook, options, len(tensors), *tensors, *params)
    return hook.rule.assemble(hook.module, out, options)


class LayerHook:
    """What one attached module carries: its rule, its name, and the engine to report to."""

    def __init__(self, engine, module: nn.Module, name: str, rule: LayerRule):
        self.engine, self.module, self.name, self.rule = engine, module, name, rule
        self.module_forward = module.forward

    def run(self, x, params: list, extra: tuple[tuple, dict]):
        """One clipped call (:func:`run_call`); a hook whose layer computes its tensors otherwise overrides it
        (``parametrized.py``)."""
        return run_call(self, x, params, extra)

    def original_forward(self, x, extra: tuple[tuple, dict] = ((), {})):
        """What the engine runs when it does not clip (eval, no grad), with the call's other arguments."""
        return self.module_forward(x, *extra[0], **extra[1])

    def __call__(self, *args, **kwargs):
        if self.rule.multi_input:
            if not args:  # the first input given by name, e.g. mha(query=q, key=k, value=v)
                first = next(iter(inspect.signature(self.module_forward).parameters))
                args = (kwargs.pop(first),) if first in kwargs else ()
            if not args:
                raise TypeError(f"{type(self.module).__name__} '{self.name}' was called without its first input.")
            return self.engine._forward(self, args[0], (args[1:], kwargs))
        if len(args) != 1 or kwargs:
            raise UnsupportedLayerError(
                f"{type(self.module).__name__} '{self.name}' was called with extra arguments; "
                "per-example clipping supports the single-input form only."
            )
        return self.engine._forward(self, args[0])

