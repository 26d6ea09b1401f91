"""Layer rules and the autograd function that lets a layer emit its own clipped weight gradient.

A *rule* knows one layer family (``nn.Linear``, ``nn.Conv2d``, ...): the plain forward, the input
gradient, the per-example squared gradient norms of its trainable parameters, and the sum of the
per-example gradients weighted by clipping coefficients. ``PerSampleFunction`` runs the forward and, in
backward, asks the engine what to return for the parameters, so DeepSpeed's own gradient hooks see the
*clipped* gradient (DESIGN §4: no patching of DeepSpeed).

Shapes: ``x`` is the layer input with the batch first, ``(B, ...)``; ``g`` is the gradient of the
(scaled) loss with respect to the layer output, ``(B, ...)``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


class LayerRule:
    """Per-example machinery for one layer family. Subclasses live one family per file."""

    #: module classes handled (a subclass is accepted when it overrides none of ``forward_methods``)
    module_types: tuple[type, ...] = ()
    #: methods whose override by a subclass changes what the layer computes (the subclass is then refused)
    forward_methods: tuple[str, ...] = ("forward",)
    #: names of the parameters the rule covers, in the order passed to :class:`PerSampleFunction`
    param_names: tuple[str, ...] = ("weight", "bias")

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


class UnsupportedLayerError(RuntimeError):
    """A trainable parameter would not receive a clipped per-example gradient (DESIGN I5)."""


class PerSampleFunction(torch.autograd.Function):
    """``out = rule.forward(module, x, *params)``; backward returns the engine's clipped parameter gradients.

    The parameters are inputs of the function, so autograd accumulates what backward returns into
    ``param.grad`` and DeepSpeed's reduce hooks fire on it as on any gradient.
    """

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


class LayerHook:
    """What one attached module carries: its rule, its name, and the engine to report to."""

    def __init__(self, engine, module: nn.Module, name: str, rule: LayerRule):
        self.engine, self.module, self.name, self.rule = engine, module, name, rule
        self.original_forward = module.forward
        self.calls = 0  # forward calls since the last backward (a reused module is refused)

    def trainable(self) -> list[bool]:
        return [p is not None and p.requires_grad for p in self.rule.params(self.module)]

    def __call__(self, x, *args, **kwargs):
        if args or kwargs:
            raise UnsupportedLayerError(
                f"{type(self.module).__name__} '{self.name}' was called with extra arguments; "
                "per-example clipping supports the single-input form only."
            )
        return self.engine._forward(self, x)


def batch_rows(t: torch.Tensor) -> torch.Tensor:
    """``(B, ...)`` → ``(B, T, d)`` where T folds every middle dimension (a sequence of T tokens)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])  # explicit: B may be 0


def param_shape(p: torch.Tensor) -> torch.Size:
    """The full shape of a parameter, also while ZeRO-3 has released its data (``ds_shape``)."""
    return getattr(p, "ds_shape", p.shape)
