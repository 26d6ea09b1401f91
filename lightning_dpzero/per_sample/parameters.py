"""Parameters a module uses directly in its forward: a ViT class token ``(1, 1, d)``, a learned position
embedding ``(1, T, d)``, register or mask tokens.

Such a parameter ``P`` of shape ``(1, *S)`` is, by convention, broadcast over the batch. During the
module's forward (only while the engine clips) the attribute is shadowed by a per-example view
``E = P.expand(B, *S)`` made by :class:`BroadcastParameterFunction`; the forward's own code then broadcasts
``E`` exactly as it would ``P`` (``torch.cat((E.expand(B, -1, -1), x), 1)``, ``x + E``, ``E[:, :n]``), and
the gradient reaching ``E`` *is* the per-example gradient, ``(B, *S)``: row ``i`` is example ``i``'s
gradient of ``P`` (``P`` needs no instantiation beyond its own size per example; such parameters are small).

All trainable direct parameters of one module form one *site* (one autograd function), so layer-wise
clipping keeps them in one group returned through autograd, like a layer's weight and bias.

The expansion changes the forward's semantics if the forward does anything but broadcast ``P`` over the
batch (``F.linear(x, P)`` with ``P`` of shape ``(1, d)``, ``P.sum()``), and attributes gradients to the
wrong examples if broadcasting aligns the view's first dimension with another one (a ``(1, d)`` parameter
added to ``(B, T, d)`` activations when ``T == B``). :class:`ParameterHook` therefore checks once, on the
first clipped micro-batch with two or more examples, that the forward's outputs with the per-example views
equal those of the original forward under the same random state, and that perturbing example 0's views
changes no other example's output; a failure is refused with
:class:`~lightning_dpzero.per_sample.base.UnsupportedLayerError` naming the parameters. That costs two
extra forwards of the module without gradients, once. (With one example the views *are* ``P``, so
the per-example gradient is exact whatever the forward does.)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .base import LayerHook, LayerRule, UnsupportedLayerError, param_shape


def broadcast_candidates(module: nn.Module) -> list[str]:
    """Names of the trainable direct parameters of ``module`` whose first dimension is 1."""
    return [n for n, p in module.named_parameters(recurse=False)
            if p.requires_grad and p.dim() >= 1 and p.shape[0] == 1]


class BroadcastParameterRule(LayerRule):
    """Per-example norms and clipped sums for a module's direct parameters ``P`` of shape ``(1, *S)``.

    ``x`` is an empty ``(B, 0)`` tensor (only its batch size is read); ``g`` is a tuple with, per parameter,
    the gradient of its per-example view, ``(B, *S)``, or ``None`` when this forward did not use it.
    """

    def __init__(self, names: list[str], params: list[nn.Parameter]):
        self.param_names, self._params = tuple(names), list(params)

    def params(self, module):
        return list(self._params)  # the Parameters themselves, also while their views are swapped in

    def norm_sq(self, module, x, g, mask):
        return [None if not m else (x.new_zeros(x.shape[0], dtype=torch.float32) if gi is None
                                    else gi.float().flatten(1).pow(2).sum(1))
                for gi, m in zip(g, mask)]

    def per_example(self, module, x, g, mask):
        return [None if not m else (torch.zeros(x.shape[0], *param_shape(p), device=x.device) if gi is None
                                    else gi.float().unsqueeze(1))
                for gi, m, p in zip(g, mask, self.params(module))]

    def clipped_grads(self, module, x, g, coef, mask):
        out: list[Optional[torch.Tensor]] = []
        for gi, m, p in zip(g, mask, self.params(module)):
            if not m:
                out.append(None)
            elif gi is None:
                out.append(torch.zeros(param_shape(p), dtype=p.dtype, device=x.device))
            else:
                w = coef.to(gi.dtype).view(-1, *[1] * (gi.dim() - 1))
                out.append((gi * w).sum(0, keepdim=True))
        return out


class BroadcastParameterFunction(torch.autograd.Function):
    """``(P_1, …, P_k) ↦ (P_1.expand(B, …), …)``; backward hands the per-example gradients to the engine and
    returns its clipped sums for ``P_1, …, P_k``."""

    @staticmethod
    def forward(ctx, hook, b, *params):
        ctx.hook, ctx.b = hook, b
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*params)
        return tuple(p.expand(b, *p.shape[1:]) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        params = ctx.saved_tensors
        x = torch.empty(ctx.b, 0, device=params[0].device)
        return (None, None, *ctx.hook.engine._on_backward(ctx.hook, x, grads, list(params)))


def _batch_size(args, kwargs) -> Optional[int]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.dim() >= 1:
            return a.shape[0]
    return None


def _same_outputs(a, b) -> bool:
    fa, fb = tree_flatten(a)[0], tree_flatten(b)[0]
    if len(fa) != len(fb):
        return False
    for u, v in zip(fa, fb):
        if isinstance(u, torch.Tensor) != isinstance(v, torch.Tensor):
            return False
        if isinstance(u, torch.Tensor):
            if u.shape != v.shape or u.dtype != v.dtype:
                return False
            tol = 1e-5 if u.dtype in (torch.float32, torch.float64) else 1e-2
            if u.is_floating_point() and not torch.allclose(u, v, rtol=tol, atol=tol, equal_nan=True):
                return False
            if not u.is_floating_point() and not torch.equal(u, v):
                return False
    return True


class ParameterHook(LayerHook):
    """Wraps ``module.forward`` (an instance attribute) to swap its direct parameters for per-example views
    while the engine clips; see the module docstring."""

    def __init__(self, engine, module: nn.Module, name: str, names: list[str]):
        self.params_ = [module._parameters[n] for n in names]
        super().__init__(engine, module, name, BroadcastParameterRule(names, self.params_))
        self.verified = False

    def __call__(self, *args, **kwargs):
        eng = self.engine
        if not eng.clipping_now():
            return self.module_forward(*args, **kwargs)
        b = eng.expected_batch_size if eng.expected_batch_size is not None else _batch_size(args, kwargs)
        if b is None:
            raise UnsupportedLayerError(
                f"{type(self.module).__name__} '{self.name}' uses the parameters {list(self.rule.param_names)} "
                "directly; their per-example gradients need the batch size: call it with a batch-first tensor "
                "or inside PerSampleEngine.micro_batch(batch_size=...).")
        live = [p for p in self.params_ if p.requires_grad]
        names = [n for n, p in zip(self.rule.param_names, self.params_) if p.requires_grad]
        reference = None
        if not self.verified and b >= 2:
            reference = self._plain_forward(args, kwargs)
            self._check_locality(args, kwargs, b, names, live, reference)
        eng._register_site(self)
        views = BroadcastParameterFunction.apply(self, b, *live)
        out = self._forward_with(names, views, args, kwargs)
        if reference is not None:
            if not _same_outputs(reference, out):
                raise self._refusal("its output changed when they were given per example")
            self.verified = True
        return out

    def _forward_with(self, names, tensors, args, kwargs, grad=True):
        # Shadow the attributes in the instance dict (found before nn.Module.__getattr__ looks in _parameters):
        # ``_parameters`` keeps the Parameters, which DeepSpeed ZeRO-3 walks during the forward.
        shadow = self.module.__dict__
        try:
            for n, v in zip(names, tensors):
                shadow[n] = v
            if grad:
                try:
                    return self.module_forward(*args, **kwargs)
                except RuntimeError as e:
                    raise self._refusal(f"its forward failed with them ({e})") from e
            return self._plain_forward(args, kwargs)
        finally:
            for n in names:
                shadow.pop(n, None)

    def _plain_forward(self, args, kwargs):
        """The forward without gradients (the engine then stays out of it) under a forked random state, so
        dropout draws what the real forward will draw."""
        devices = [p.device.index for p in self.params_ if p.is_cuda][:1]
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            return self.module_forward(*args, **kwargs)

    def _check_locality(self, args, kwargs, b, names, live, reference) -> None:
        """Perturb example 0's views only: no other example's output may change. Broadcasting that aligns a
        view's first dimension with anything but the batch (a ``(1, d)`` parameter added to ``(B, T, d)``
        activations when ``T == B``) gives equal outputs above but is caught here."""
        gen = torch.Generator(device=live[0].device).manual_seed(0)
        views = []
        for p in live:
            v = p.detach().expand(b, *p.shape[1:]).clone()
            noise = torch.randn(v[0].shape, generator=gen, device=v.device, dtype=torch.float32)
            v[0] += (noise * (v[0].float().abs().mean() + 1)).to(v.dtype)
            views.append(v)
        try:
            perturbed = self._forward_with(names, views, args, kwargs, grad=False)
        except RuntimeError as e:
            raise self._refusal(f"its forward failed with them ({e})") from e
        outs = [(u, v) for u, v in zip(tree_flatten(reference)[0], tree_flatten(perturbed)[0])
                if isinstance(u, torch.Tensor) and u.is_floating_point() and u.dim() >= 1 and u.shape[0] == b]
        if not outs:
            raise self._refusal(f"its output has no batch dimension of size {b} to check that each example's "
                                "view reaches that example's output only")
        for u, v in outs:
            if v.shape != u.shape or not torch.allclose(u[1:].float(), v[1:].float(), rtol=1e-4, atol=1e-6):
                raise self._refusal("changing one example's view changed other examples' outputs (the view's "
                                    "first dimension is not aligned with the batch)")

    def _refusal(self, what: str) -> UnsupportedLayerError:
        return UnsupportedLayerError(
            f"{type(self.module).__name__} '{self.name}' uses the parameters {list(self.rule.param_names)} "
            f"directly in its forward; to clip them per example they are replaced there by per-example views "
            f"of shape (B, ...) in place of their first dimension 1, and {what}. Only parameters that the "
            "forward broadcasts over the batch (class token, position embedding) are supported: move a "
            "parameter used otherwise into a supported layer (nn.Linear, nn.Embedding), or freeze it.")
