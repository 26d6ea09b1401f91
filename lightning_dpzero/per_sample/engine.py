"""The per-example engine: attaches to a module's supported layers and clips per example (DESIGN §2, §4).

Usage without Lightning (the functional API the strategy uses)::

    engine = PerSampleEngine(model, max_grad_norm=1.0, clipping="layer-wise")
    engine.attach()
    with engine.micro_batch(batch_size=B):           # loss = mean of the B per-example losses
        model(x).pow(2).mean().backward()
    # every trainable p.grad now holds Σ_i clip(g_i)  (the *sum* of clipped per-example gradients)

Layer-wise clipping finishes inside each layer's backward. All-layer clipping records each layer's
input and output gradient during backward and, once every layer's norm is known (at the end of the
backward pass), forms the clipped gradients and adds them to ``p.grad`` (book-keeping, Bu et al. 2023).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
from torch import nn

from .base import LayerHook, PerSampleFunction, UnsupportedLayerError
from .clipping import clip_coefficients, layer_thresholds, validate_clipping
from .registry import find_rule, unsupported_reason


class PerSampleEngine:
    """Per-example clipping for every trainable parameter of ``module``.

    Args:
        module: any ``nn.Module``; every trainable parameter must belong to a supported layer.
        max_grad_norm: C, the bound on each example's total gradient norm (``math.inf``: no clipping).
        clipping: ``"layer-wise"`` (each of the K layers clipped to C/sqrt(K)) or ``"all-layer"``.
        clipping_fn: ``"abadi"`` (``min(1, C/‖g‖)``) or ``"automatic"`` (``C/(‖g‖+γ)``).
        gamma: γ of automatic clipping.
        loss_reduction: ``"mean"`` if the loss is the mean of per-example losses over the micro-batch
            (Lightning's convention), ``"sum"`` if it is their sum.

    Raises:
        UnsupportedLayerError: from :meth:`attach`, naming each trainable parameter no rule covers.
        ValueError: for a bad setting.
    """

    def __init__(self, module: nn.Module, max_grad_norm: float = 1.0, clipping: str = "layer-wise",
                 clipping_fn: str = "abadi", gamma: float = 0.01, loss_reduction: str = "mean"):
        validate_clipping(clipping, clipping_fn, max_grad_norm, gamma)
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r}; use 'mean' or 'sum'.")
        self.module, self.max_grad_norm, self.clipping = module, float(max_grad_norm), clipping
        self.clipping_fn, self.gamma, self.loss_reduction = clipping_fn, gamma, loss_reduction
        self.hooks: list[LayerHook] = []
        self.active = False
        # Set per micro-batch by the caller (see ``micro_batch``):
        self.expected_batch_size: Optional[int] = None
        self.grad_scale = 1.0  # observed grad × grad_scale = gradient of the per-example loss (× B for "mean")
        self.emit_scale = 1.0  # multiplies what is written to p.grad (e.g. a loss scale DeepSpeed divides out)
        self.on_finalize = None  # optional callback after all-layer gradients were written
        self._records: list[tuple] = []
        self._total_sq: Optional[torch.Tensor] = None
        self._pending = False
        self.reset_stats()

    # ---------------------------------------------------------------- attach / validate
    def attach(self) -> "PerSampleEngine":
        """Replace the forward of each supported layer (instance attribute only) and check coverage (I5)."""
        if self.hooks:
            return self
        covered: set[int] = set()
        for name, mod in self.module.named_modules():
            rule = find_rule(mod)
            if rule is None:
                continue
            trainable = [p is not None and p.requires_grad for p in rule.params(mod)]
            own = {id(p) for p in mod.parameters(recurse=False)}
            covered |= {id(p) for p in rule.params(mod) if p is not None}
            if not any(trainable):
                continue
            if own - {id(p) for p in rule.params(mod) if p is not None}:
                continue  # extra parameters: reported as uncovered below
            rule.check(mod, name or type(mod).__name__)
            hook = LayerHook(self, mod, name or type(mod).__name__, rule)
            mod.forward = hook
            self.hooks.append(hook)
        self._check_coverage(covered)
        self.thresholds = layer_thresholds(self.max_grad_norm, len(self.hooks))
        self.active = True
        return self

    def _check_coverage(self, covered: set[int]) -> None:
        seen: dict[int, str] = {}
        missing = []
        for mname, mod in self.module.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                full = f"{mname}.{pname}" if mname else pname
                if id(p) in seen:
                    missing.append(f"'{full}' is tied to '{seen[id(p)]}' (tied parameters are not supported yet: "
                                   "untie them or freeze one with requires_grad=False)")
                    continue
                seen[id(p)] = full
                if id(p) not in covered:
                    missing.append(f"'{full}' of {type(mod).__name__} '{mname or '<root>'}': "
                                   f"{unsupported_reason(mod)}")
        if missing:
            self.detach()
            raise UnsupportedLayerError(
                "Differential privacy needs a clipped per-example gradient for every trainable parameter, "
                "but these are not covered:\n  - " + "\n  - ".join(missing)
                + "\nFix: replace the layer with a supported one (e.g. BatchNorm -> GroupNorm/LayerNorm), or "
                "freeze the parameter with requires_grad=False."
            )

    def detach(self) -> None:
        for h in self.hooks:
            if h.module.__dict__.get("forward") is h:
                del h.module.forward
        self.hooks, self.active = [], False

    # ---------------------------------------------------------------- per micro-batch
    @contextlib.contextmanager
    def micro_batch(self, batch_size: int, grad_scale: float = 1.0, emit_scale: float = 1.0) -> Iterator[None]:
        """Declare the micro-batch: ``batch_size`` examples; see ``grad_scale`` / ``emit_scale`` attributes."""
        self.expected_batch_size = batch_size
        self.grad_scale, self.emit_scale = grad_scale, emit_scale
        self.new_forward()
        try:
            yield
        finally:
            self.finalize()
            self.expected_batch_size = None

    def _forward(self, hook: LayerHook, x: torch.Tensor) -> torch.Tensor:
        if not (self.active and torch.is_grad_enabled() and self.module.training):
            return hook.original_forward(x)
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise UnsupportedLayerError(f"'{hook.name}' needs a tensor input with the batch dimension first.")
        b = self.expected_batch_size
        if b is not None and x.shape[0] != b:
            raise UnsupportedLayerError(
                f"{type(hook.module).__name__} '{hook.name}' received an input whose first dimension is "
                f"{x.shape[0]}, but the micro-batch has {b} examples. Per-example clipping needs the batch "
                "dimension first in every layer: keep inputs as (B, T, d) instead of flattening to (B*T, d), "
                "and use batch_first=True."
            )
        hook.calls += 1
        if hook.calls > 1:
            # Two separately clipped contributions of one parameter would bound its per-example gradient
            # by 2·C, not C: refuse rather than under-state the sensitivity.
            raise UnsupportedLayerError(
                f"{type(hook.module).__name__} '{hook.name}' was called more than once in one forward pass; "
                "per-example clipping of a reused module is not supported yet. Use a separate module per call.")
        return PerSampleFunction.apply(hook, x, *hook.rule.params(hook.module))

    # ---------------------------------------------------------------- backward
    def _on_backward(self, hook: LayerHook, x, g, params) -> list[Optional[torch.Tensor]]:
        if not self._pending:  # one finalize per backward pass (all-layer gradients, statistics)
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
        trainable = hook.trainable()
        sq = hook.rule.norm_sq(hook.module, x, g, trainable)
        scale = self.grad_scale * (x.shape[0] if self.loss_reduction == "mean" else 1)
        if self.clipping == "layer-wise":
            norms = sq.sqrt() * scale
            self._accumulate_total(norms.pow(2))
            coef = clip_coefficients(norms, self.thresholds, self.clipping_fn, self.gamma)
            return hook.rule.clipped_grads(hook.module, x, g, coef * (scale * self.emit_scale), trainable)
        # all-layer: book-keep; the clipped gradient is formed once every layer's norm is known.
        self._accumulate_total(sq * scale * scale)
        self._records.append((hook, x, g, scale, trainable))
        return [torch.zeros_like(p) if (p is not None and t) else None for p, t in zip(params, trainable)]

    def _accumulate_total(self, sq: torch.Tensor) -> None:
        self._total_sq = sq if self._total_sq is None else self._total_sq + sq

    def new_forward(self) -> None:
        """Start of a micro-batch's forward: reset the per-module call counts."""
        for h in self.hooks:
            h.calls = 0

    def finalize(self) -> None:
        """End of a backward pass: all-layer gradients are written, statistics updated. Idempotent."""
        self._pending = False
        self.new_forward()
        total = self._total_sq
        self._total_sq = None
        if total is None:
            return
        norms = total.sqrt()
        if self.clipping == "all-layer":
            coef = clip_coefficients(norms, self.max_grad_norm, self.clipping_fn, self.gamma)
            for hook, x, g, scale, trainable in self._records:
                grads = hook.rule.clipped_grads(hook.module, x, g, coef * (scale * self.emit_scale), trainable)
                for p, gr in zip(hook.rule.params(hook.module), grads):
                    if gr is None:
                        continue
                    if p.grad is None:
                        p.grad = gr.to(p.dtype)
                    else:
                        p.grad.add_(gr.to(p.grad.dtype).view_as(p.grad))
            self._records = []
            if self.on_finalize is not None:
                self.on_finalize()
        self._update_stats(norms)

    # ---------------------------------------------------------------- statistics
    def reset_stats(self) -> None:
        self.stats = {"examples": 0, "clipped": 0, "norm_sum": 0.0}

    def _update_stats(self, norms: torch.Tensor) -> None:
        # "clipped": the example's total norm exceeded C (its update was scaled down).
        n = norms.detach()
        self.stats["examples"] += int(n.numel())
        if not math.isinf(self.max_grad_norm):
            self.stats["clipped"] += int((n > self.max_grad_norm).sum())
        self.stats["norm_sum"] += float(n.sum())
