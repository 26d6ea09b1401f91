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
added to ``(B, T, d)`` activations when ``T == B``, or indexing such as ``pos_embed[-1]``).
:class:`ParameterHook` therefore checks once per module, at the first clipped micro-batch of two or more
examples, that the forward's outputs with the per-example views equal those of the original forward under the same
random state, and that perturbing the views of a set of examples changes no other example's output
(``2 * CHECK_BITS`` sets); a failure is refused with
:class:`~lightning_dpzero.per_sample.base.UnsupportedLayerError` naming the parameters. That costs
``1 + 2 * CHECK_BITS`` extra forwards of the module without gradients, once, on copies of its inputs.
(With one example the views *are* ``P``, so its per-example gradient is exact whatever the forward does.)
Under ZeRO-3 on several processes forwards gather parameters collectively, so every rank runs the check at
its first clipped micro-batch, whatever its size, comparing only where it has two or more examples.

A module whose direct parameters are not all of shape ``(1, ...)`` (ConvNeXt's layer scale ``(C,)``, CLIP's class
embedding ``(d,)``, Mamba's ``A_log``; only next to trainable children, see ``coverage.py``) gives its forward
shared values instead of views (``broadcast.py``): the copies ``P.expand(B, *P.shape)`` come from the same
autograd function, and are substituted where the forward broadcasts each value over the batch.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .base import LayerHook, Site, UnsupportedLayerError
from .broadcast import Origin, Shared, gathered_in_backward, layout_copy
from .generic import InstantiatedGradsRule


#: perturbation rounds of the once-per-module locality check: 2 * CHECK_BITS forwards without gradients
CHECK_BITS = 6


def broadcast_candidates(module: nn.Module) -> list[str]:
    """Names of the trainable direct parameters of ``module`` whose first dimension is 1."""
    return [n for n, p in module.named_parameters(recurse=False)
            if p.requires_grad and p.dim() >= 1 and p.shape[0] == 1]


class BroadcastParameterRule(InstantiatedGradsRule):
    """Per-example norms and clipped sums for a module's direct parameters ``P`` of shape ``(1, *S)``: ``site.g``
    holds, per parameter, the gradient of its per-example view as ``(B, 1, *S)`` (zeros when this forward did
    not use it)."""


class BroadcastParameterFunction(torch.autograd.Function):
    """``(P_1, …, P_k) ↦ (P_1.expand(B, …), …)``; backward hands the per-example gradients to the engine and
    returns its clipped sums for ``P_1, …, P_k``."""

    @staticmethod
    def forward(ctx, hook, b, whole, *params):
        # whole: P.expand(B, *P.shape), the copies of shared values (broadcast.py); else (B, *S) for P (1, *S)
        ctx.hook, ctx.b, ctx.whole = hook, b, whole
        ctx.save_for_backward(*params)
        return tuple(p.expand(b, *p.shape[0 if whole else 1:]) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        params = ctx.saved_tensors
        g = grads if ctx.whole else tuple(gi.unsqueeze(1) for gi in grads)
        site = Site(ctx.hook, torch.empty(ctx.b, 0, device=params[0].device), g)
        return (None, None, None, *ctx.hook.engine._on_backward(site, list(params)))


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

    def __init__(self, engine, module: nn.Module, name: str, names: list[str], shared: bool = False):
        # a dotted name is a child's parameter that this module's forward reads directly (coverage.py)
        self.params_ = [module.get_parameter(n) for n in names]
        super().__init__(engine, module, name, BroadcastParameterRule(names, self.params_))
        self.verified = False
        # a parameter not of shape (1, ...) (ConvNeXt's layer scale (C,), CLIP's class embedding (d,)), or any
        # parameter of a module whose forward takes no input (``shared``), is given to the forward as a shared
        # value, traced to where the forward broadcasts it (broadcast.py)
        self.shared = shared or any(p.dim() == 0 or p.shape[0] != 1 for p in self.params_)
        self.input_free = shared

    def __call__(self, *args, **kwargs):
        eng = self.engine
        if not eng.clipping_now():
            eng._record_call(self, args, kwargs)
            if self.shared and eng._layout is not None:  # the layout check records its broadcast points
                origin = Origin(self, None, record=eng._layout)
                # p.detach(): the values as gathered now (ZeRO-3 partitions p after this forward, and an input-free
                # module's output is broadcast after it: the copies are made there)
                values = [Shared(p, origin, layout_copy(p.detach(), eng._layout)) for p in self._read(self.params_)]
                return self._forward_with(self.rule.param_names, values, args, kwargs)
            return self.module_forward(*args, **kwargs)
        b = eng.expected_batch_size if eng.expected_batch_size is not None else _batch_size(args, kwargs)
        if b is None:
            raise UnsupportedLayerError(
                f"{type(self.module).__name__} '{self.name}' uses the parameters {list(self.rule.param_names)} "
                "directly; their per-example gradients need the batch size: call it with a batch-first tensor "
                "or inside PerSampleEngine.micro_batch(batch_size=...).")
        live = [p for p in self.params_ if p.requires_grad]
        names = [n for n, p in zip(self.rule.param_names, self.params_) if p.requires_grad]
        if self.shared:
            eng._register_site(self)
            live = self._read(live)
            copies = BroadcastParameterFunction.apply(self, b, True, *live)
            origin = Origin(self, b, check=not self.verified)
            self.verified = self.verified or b >= 2
            values = [Shared(p.detach().clone(), origin, (lambda c=c: c)) for p, c in zip(live, copies)]
            out = self._forward_with(names, values, args, kwargs)
            if self.input_free:  # its output is broadcast after its forward: gathered for the backward there
                gathered_in_backward(out, self)
            return out
        reference = None
        if not self.verified and (b >= 2 or self._collective_forward()):
            # Under ZeRO-3 on several ranks each forward gathers parameters collectively, so every rank checks on
            # its first clipped micro-batch with the same number of forwards whatever its B; otherwise the check
            # waits for a micro-batch of two or more examples.
            reference = self._plain_forward(args, kwargs)
            self._check_locality(args, kwargs, b, names, live, reference)
        eng._register_site(self)
        views = BroadcastParameterFunction.apply(self, b, False, *live)
        out = self._forward_with(names, views, args, kwargs)
        if reference is not None:
            if b >= 2 and not _same_outputs(reference, out):
                raise self._refusal("its output changed when they were given per example")
            self.verified = True
        return out

    def _collective_forward(self) -> bool:
        dist = torch.distributed
        return (any(hasattr(p, "ds_id") for p in self.params_)  # a DeepSpeed ZeRO-3 parameter
                and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)

    def _forward_with(self, names, tensors, args, kwargs, grad=True):
        # Shadow the attributes in the instance dict (found before nn.Module.__getattr__ looks in _parameters):
        # ``_parameters`` keeps the Parameters, which DeepSpeed ZeRO-3 walks during the forward.
        try:
            for n, v in zip(names, tensors):
                owner, attr = self._owner(n)
                owner.__dict__[attr] = v
            if grad:
                try:
                    return self.module_forward(*args, **kwargs)
                except UnsupportedLayerError:
                    raise
                except RuntimeError as e:
                    raise self._refusal(f"its forward failed with them ({e})") from e
            return self._plain_forward(args, kwargs)
        finally:
            for n in names:
                owner, attr = self._owner(n)
                owner.__dict__.pop(attr, None)

    def _read(self, params: list) -> list:
        """``params`` read from their modules as the forward reads them: ZeRO-3 gathers a child's parameter when
        it is read so during a forward (Mamba's ``conv1d.weight``), its hook gathers only the module's own."""
        names = {id(p): n for n, p in zip(self.rule.param_names, self.params_)}
        return [owner._parameters[attr] for owner, attr in (self._owner(names[id(p)]) for p in params)]

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        """The module holding parameter ``name`` (this one, or a child for a dotted name) and its attribute."""
        path, _, attr = name.rpartition(".")
        return (self.module.get_submodule(path) if path else self.module), attr

    def _plain_forward(self, args, kwargs):
        """The forward without gradients (the engine then stays out of it) under a forked random state, so
        dropout draws what the real forward will draw."""
        devices = [p.device.index for p in self.params_ if p.is_cuda][:1]
        # fresh copies of the inputs: a forward that updates its input in place must not see it twice
        args, kwargs = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            return self.module_forward(*args, **kwargs)

    def _check_locality(self, args, kwargs, b, names, live, reference) -> None:
        """Perturb the views of a set S of examples: no example outside S may see its output change. With S
        and its complement for each of ``CHECK_BITS`` bits of a fixed permutation of the example indices,
        any forward in which some example's output reads another example's view is caught (exactly for
        B <= 2**CHECK_BITS): broadcasting that aligns a view's first dimension with another one (a ``(1, d)``
        parameter added to ``(B, T, d)`` when ``T == B``), or indexing such as ``pos_embed[-1]``. The
        outputs with unperturbed views equal the original's, so those checks pass unnoticed otherwise."""
        gen = torch.Generator().manual_seed(0)
        order = torch.randperm(max(b, 1), generator=gen)[:b]
        for bit in range(CHECK_BITS):
            for side in (0, 1):
                chosen = ((order >> bit) & 1) == side  # (b,) examples whose views are perturbed
                views = []
                for p in live:
                    v = p.detach().expand(b, *p.shape[1:]).clone()
                    noise = torch.randn(v.shape, generator=gen, dtype=torch.float32).to(v.device)
                    scale = v.float().abs().mean() + 1 if v.numel() else 1.0
                    shape = (-1, *[1] * (v.dim() - 1))
                    v += (noise * scale * chosen.to(v.device).view(shape)).to(v.dtype)
                    views.append(v)
                try:
                    perturbed = self._forward_with(names, views, args, kwargs, grad=False)
                except RuntimeError as e:
                    raise self._refusal(f"its forward failed with them ({e})") from e
                if b >= 2:
                    self._compare_untouched(reference, perturbed, b, ~chosen)

    def _compare_untouched(self, reference, perturbed, b, keep) -> None:
        outs = [(u, v) for u, v in zip(tree_flatten(reference)[0], tree_flatten(perturbed)[0])
                if isinstance(u, torch.Tensor) and u.is_floating_point() and u.dim() >= 1 and u.shape[0] == b]
        if not outs:
            raise self._refusal(f"its output has no batch dimension of size {b} to check that each example's "
                                "view reaches that example's output only")
        for u, v in outs:
            rows = keep.to(u.device)
            if v.shape != u.shape or not torch.allclose(u[rows].float(), v[rows].float(), rtol=1e-4, atol=1e-6):
                raise self._refusal("changing some examples' views changed other examples' outputs (an example's "
                                    "output reads another example's view)")

    def _refusal(self, what: str) -> UnsupportedLayerError:
        return UnsupportedLayerError(
            f"{type(self.module).__name__} '{self.name}' uses the parameters {list(self.rule.param_names)} "
            f"directly in its forward; to clip them per example they are replaced there by per-example views "
            f"of shape (B, ...) in place of their first dimension 1, and {what}. Only parameters that the "
            "forward broadcasts over the batch (class token, position embedding) are supported: move a "
            "parameter used otherwise into a supported layer (nn.Linear, nn.Embedding), or freeze it.")
