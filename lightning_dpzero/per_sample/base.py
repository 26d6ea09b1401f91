"""Layer rules and the autograd function that lets a layer emit its own clipped weight gradient.

A *rule* knows one layer family (``nn.Linear``, ``nn.Conv2d``, ...): the plain forward, the input
gradient, the per-example squared gradient norms of its trainable parameters, and the sum of the
per-example gradients weighted by clipping coefficients. ``PerSampleFunction`` runs the forward and, in
backward, asks the engine what to return for the parameters, so DeepSpeed's own gradient hooks see the
*clipped* gradient (DESIGN §4: no patching of DeepSpeed).

Shapes: ``x`` is the layer input with the batch first, ``(B, ...)``; ``g`` is the gradient of the
(scaled) loss with respect to the layer output, ``(B, ...)``.

Layers called with several tensors and options (attention: ``mha(q, k, v, key_padding_mask=...)``) set
``LayerRule.multi_input``: the hook keeps the call's other arguments, ``PerSampleFunction.apply`` hands the
rule's :meth:`~LayerRule.bind` result to :class:`MultiInputFunction`, whose backward asks the rule for the
input gradients *and* what its norms need in one go (:meth:`~LayerRule.backward_multi`). ``x`` and ``g`` are
then whatever the rule records (an :class:`Inputs` for ``x``, whose ``shape[0]`` is the batch size).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import nn


class LayerRule:
    """Per-example machinery for one layer family. Subclasses live one family per file."""

    #: module classes handled (a subclass is accepted when it overrides none of ``forward_methods``)
    module_types: tuple[type, ...] = ()
    #: methods whose override by a subclass changes what the layer computes (the subclass is then refused)
    forward_methods: tuple[str, ...] = ("forward",)
    #: the layer takes several tensors/options (see the module docstring); single-input rules leave it False
    multi_input: bool = False
    #: names of the parameters the rule covers, in the order passed to :class:`PerSampleFunction`
    param_names: tuple[str, ...] = ("weight", "bias")
    #: ``norm_sq`` accepts ``keep=True``, which the engine passes when the site completes its clipping groups
    #: (layer-wise): ``clipped_grads`` for the same ``x``/``g`` objects follows at once, so the rule may reuse
    #: per-example tensors its norm formed (``linear.KeptSites``) instead of recomputing them
    keeps_per_example: bool = False

    def check(self, module: nn.Module, name: str) -> None:
        """Raise ``UnsupportedLayerError`` for configurations the rule cannot clip (before training)."""

    def params(self, module: nn.Module) -> list[Optional[torch.Tensor]]:
        return [getattr(module, n, None) for n in self.param_names]

    def forward(self, module: nn.Module, x: torch.Tensor, *params: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def grad_input(self, module, x, params, g) -> torch.Tensor:
        """Gradient with respect to ``x``; the default recomputes the forward under autograd."""
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(True)
            out = self.forward(module, x_, *[p.detach() if p is not None else None for p in params])
            (gx,) = torch.autograd.grad(out, x_, g)
        return gx

    def norm_sq(self, module, x, g, mask: list[bool]) -> list[Optional[torch.Tensor]]:
        """Per parameter (``None`` where ``mask`` is False): per-example squared gradient norms, ``(B,)`` fp32."""
        raise NotImplementedError

    def per_example(self, module, x, g, mask: list[bool]) -> list[Optional[torch.Tensor]]:
        """Per parameter: the instantiated per-example gradients ``(B, *param.shape)`` fp32 (for parameters
        shared by several call sites, whose norm needs the sum of the sites' contributions)."""
        raise NotImplementedError

    def clipped_grads(self, module, x, g, coef: torch.Tensor, mask: list[bool]) -> list[Optional[torch.Tensor]]:
        """Per parameter: ``Σ_i coef_i · g_i`` (``None`` where ``mask`` is False), in ``g``'s dtype."""
        raise NotImplementedError

    # ---- multi-input rules only (``multi_input = True``)
    def bind(self, module, x, args: tuple, kwargs: dict) -> tuple[tuple[torch.Tensor, ...], dict]:
        """Split one call ``module(x, *args, **kwargs)`` into its differentiable tensors (batch first, ``x``
        first) and a fresh dict of everything else; ``forward`` may add to it what backward needs."""
        raise NotImplementedError

    def backward_multi(self, module, inputs: "Inputs", params, grads: tuple, needs_input_grad: tuple
                       ) -> tuple[list[Optional[torch.Tensor]], Any, Any]:
        """Gradients for ``inputs`` (``None`` where not needed) and the ``(x, g)`` records that
        ``norm_sq``/``per_example``/``clipped_grads`` receive; ``grads`` has one entry per output, ``None``
        for an unused output."""
        raise NotImplementedError


class UnsupportedLayerError(RuntimeError):
    """A trainable parameter would not receive a clipped per-example gradient (DESIGN I5)."""


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
    ``param.grad`` and DeepSpeed's reduce hooks fire on it as on any gradient. ``apply`` sends calls of
    multi-input rules to :class:`MultiInputFunction`.
    """

    @classmethod
    def apply(cls, hook, x, *params):
        if not hook.rule.multi_input:
            return super().apply(hook, x, *params)
        tensors, options = hook.rule.bind(hook.module, x, *hook.extra)
        return MultiInputFunction.apply(hook, options, len(tensors), *tensors, *params)

    @staticmethod
    def forward(ctx, hook, x, *params):
        ctx.hook = hook
        ctx.has_params = [p is not None for p in params]
        ctx.save_for_backward(x, *[p for p in params if p is not None])
        return hook.rule.forward(hook.module, x, *params)

    @staticmethod
    def backward(ctx, g):
        hook = ctx.hook
        saved = list(ctx.saved_tensors)
        x = saved.pop(0)
        params = [saved.pop(0) if has else None for has in ctx.has_params]
        gx = hook.rule.grad_input(hook.module, x, params, g) if ctx.needs_input_grad[1] else None
        param_grads = hook.engine._on_backward(hook, x, g, params)
        return (None, gx, *param_grads)


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
        gin, x, g = hook.rule.backward_multi(hook.module, inputs, params, grads, ctx.needs_input_grad[3:3 + n])
        return (None, None, None, *gin, *hook.engine._on_backward(hook, x, g, params))


class LayerHook:
    """What one attached module carries: its rule, its name, and the engine to report to."""

    def __init__(self, engine, module: nn.Module, name: str, rule: LayerRule):
        self.engine, self.module, self.name, self.rule = engine, module, name, rule
        self.module_forward = module.forward
        # what the engine runs when it does not clip (eval, no grad); a multi-input call keeps its arguments
        self.original_forward = self._original_multi if rule.multi_input else module.forward
        self.extra: tuple[tuple, dict] = ((), {})  # the other arguments of the multi-input call in progress

    def _original_multi(self, x):
        return self.module_forward(x, *self.extra[0], **self.extra[1])

    def __call__(self, *args, **kwargs):
        if self.rule.multi_input:
            if not args:  # the first input given by name, e.g. mha(query=q, key=k, value=v)
                first = next(iter(inspect.signature(self.module_forward).parameters))
                args = (kwargs.pop(first),) if first in kwargs else ()
            if not args:
                raise TypeError(f"{type(self.module).__name__} '{self.name}' was called without its first input.")
            self.extra = (args[1:], kwargs)
            try:
                return self.engine._forward(self, args[0])
            finally:
                self.extra = ((), {})
        if len(args) != 1 or kwargs:
            raise UnsupportedLayerError(
                f"{type(self.module).__name__} '{self.name}' was called with extra arguments; "
                "per-example clipping supports the single-input form only."
            )
        return self.engine._forward(self, args[0])

