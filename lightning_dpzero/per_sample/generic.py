"""The generic rule: per-example gradients of any module's own parameters by ``torch.func``, for a module
that has trainable parameters of its own and no dedicated rule (HuggingFace's ``T5LayerNorm``, a user's
custom layer, a subclass of ``nn.Linear`` that overrides ``forward``).

For a call ``out = f(θ, x)`` on a batch ``x`` (B, ...) and the output gradient ``g`` (B, ...), example i's
gradient of its own loss is the vector-Jacobian product of the module applied to that example alone,
``∂/∂θ ⟨f(θ, x_i), g_i⟩`` with ``x_i`` a batch of one. The rule forms all of them in one
``torch.func.vmap`` over the examples of ``torch.func.grad`` of the module's own forward, with the
parameters (and the input, for the input gradient) as arguments: ``(B, *θ.shape)`` fp32 per parameter, then
norms and clipped sums like every other site (the :class:`InstantiatedGradsRule` arithmetic). The
parameters are swapped into the forward through the module's instance dictionary (the module's hooks, and
ZeRO-3's gathering, are not re-run), so the forward reads the very tensors being differentiated.

Tensor arguments whose first dimension is the micro-batch size B are split per example; any other tensor
(a (1, T) or (T, T) mask, a shared table) is passed whole to every example; non-tensor arguments as they
are. Every tensor output must be batch first.

That is exact only for a module whose forward treats examples independently and deterministically. So the
rule proves it before it is trusted, at its first call with two or more examples (on each rank):

* the vmapped per-example forward equals the batched forward row by row (a forward that mixes examples,
  e.g. statistics over the batch, fails), and ``vmap(randomness="error")`` refuses a forward that draws
  random numbers (dropout: its backward could not see the forward's draw);
* in that call's backward, the per-example gradients sum to the batched gradient of the same forward;

and at every call, that the forward changed none of the module's buffers and none of its inputs in place
(state kept between calls, which the recomputation in backward would not see). A failure raises
:class:`~lightning_dpzero.per_sample.base.UnsupportedLayerError` naming the module, before any gradient of
the call is returned. A module whose children hold trainable parameters is never given this rule (the
vmap would differentiate through layers that have rules of their own): see ``coverage.py``.

Cost per call: the forward once (as any layer) and, in backward, one vmapped forward and backward over the
B examples; at the first call, one more vmapped forward and one batched forward and backward. Memory: the
``(B, *θ.shape)`` gradients, plus what torch.func's batched backward holds for the module's intermediates.
``benchmarks/per_layer.py`` measures it beside the dedicated rules.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .base import LayerHook, LayerRule, Site, UnsupportedLayerError
from .maths import param_shape, per_example_sq, weighted_sum
from .provenance import Rows, rows_of, seed
from .token_major import mark_outputs, token_rows


class InstantiatedGradsRule(LayerRule):
    """A rule whose site carries the instantiated per-example gradients: ``site.g`` is a tuple with, per
    parameter, a ``(B, *param.shape)`` tensor (zeros for one the call did not use); ``site.x`` is an empty
    ``(B, 0)`` tensor (only its batch size is read). Used by the generic rule and by the parameters a forward
    uses directly (``parameters.py``)."""

    def __init__(self, names: list[str], params: list[nn.Parameter]):
        self.param_names, self._params = tuple(names), list(params)

    def params(self, module):
        return list(self._params)  # the Parameters themselves, also while a forward sees other tensors

    def norm_sq(self, site, mask):
        return [per_example_sq(gi) if m else None for gi, m in zip(site.g, mask)]

    def per_example(self, site, mask):
        return [gi.float() if m else None for gi, m in zip(site.g, mask)]

    def clipped_grads(self, site, coef, mask):
        return [weighted_sum(gi.float(), coef).to(gi.dtype) if m else None for gi, m in zip(site.g, mask)]


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` equals ``b`` up to rounding, relative to the largest entry of ``b`` (integers exactly)."""
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    tol = _tolerance(a.dtype)
    scale = float(b.detach().abs().max()) if b.numel() else 0.0
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * scale + 1e-12, equal_nan=True)


class _Call:
    """The structure of one call: argument and output trees, which tensors are split per example."""

    __slots__ = ("hook", "b", "spec", "consts", "slots", "in_dims", "out_spec", "out_consts", "out_slots", "rows",
                 "examples")

    def __init__(self, hook, b, leaves, spec, rows=None):
        self.hook, self.b, self.spec = hook, b, spec
        # token-major (token_major.py): b is the number of rows, ``rows`` their map, ``examples`` the micro-batch's
        self.rows, self.examples = rows, (b if rows is None else rows.b)
        self.slots = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self.consts = [None if isinstance(v, torch.Tensor) else v for v in leaves]
        self.in_dims = tuple(0 if leaves[k].dim() >= 1 and leaves[k].shape[0] == b else None for k in self.slots)
        self.out_spec = self.out_consts = self.out_slots = None

    def args(self, tensors, one=False):
        """The call's ``(args, kwargs)`` with ``tensors`` in its tensor slots; ``one``: an example of a vmap,
        whose split tensors get their batch dimension of one back."""
        leaves = list(self.consts)
        for k, t, d in zip(self.slots, tensors, self.in_dims):
            leaves[k] = t.unsqueeze(0) if one and d == 0 else t
        return tree_unflatten(leaves, self.spec)

    def outputs(self, out, b: int):
        """The tensor leaves of ``out`` (recording the tree on first use); each must have ``b`` rows first
        (the micro-batch, or 1 for one example of a vmap)."""
        leaves, spec = tree_flatten(out)
        slots = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        if self.out_spec is None:
            self.out_spec, self.out_slots = spec, slots
            self.out_consts = [None if isinstance(v, torch.Tensor) else v for v in leaves]
        tensors = [leaves[k] for k in slots]
        if not tensors:
            raise self.hook.refusal("its forward returns no tensor")
        for t in tensors:
            if t.dim() < 1 or t.shape[0] != b:
                raise self.hook.refusal(f"its output of shape {tuple(t.shape)} has no batch dimension of size "
                                        f"{self.b} first")
        return tensors

    def rebuild(self, tensors):
        leaves = list(self.out_consts)
        for k, t in zip(self.out_slots, tensors):
            leaves[k] = t
        return tree_unflatten(leaves, self.out_spec)


class GenericHook(LayerHook):
    """Wraps ``module.forward`` (an instance attribute): while the engine clips, each call runs through
    :class:`GenericFunction`, whose backward hands the per-example gradients of the module's own trainable
    parameters to the engine; see the module docstring."""

    def __init__(self, engine, module: nn.Module, name: str, names: list[str]):
        self.params_ = [module._parameters[n] for n in names]
        super().__init__(engine, module, name, InstantiatedGradsRule(names, self.params_))
        self.verified = False
        self.verified_rows = False  # proven on token-major calls too (its own proof: per_example_rows)
        # under ZeRO-3 a module with children is gathered as one leaf, so that the per-example recomputation in
        # backward calls no child module that DeepSpeed hooks (PerSampleEngine.zero3_leaf_types)
        self.zero3_leaf = any(True for _ in module.children())

    def __call__(self, *args, **kwargs):
        eng = self.engine
        if not eng.clipping_now():
            eng._record_call(self, args, kwargs)
            out = self.module_forward(*args, **kwargs)
            first = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim()), None)
            seed(first, eng.tracking.examples())
            mark_outputs(out, rows_of(first))
            return out
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        first = next((t for t in tensors if t.dim() >= 1), None)
        b = eng.expected_batch_size if eng.expected_batch_size is not None else (
            first.shape[0] if first is not None else None)
        rows = token_rows(self, first, tensors, b)  # the examples' tokens as rows: their map (token_major.py)
        if rows is not None:
            call = _Call(self, rows.rows, leaves, spec, rows)
            eng._register_site(self)
            outs = GenericFunction.apply(call, len(tensors), *tensors, *self.params_)
            mark_outputs(outs, rows)
            return call.rebuild(outs if isinstance(outs, tuple) else (outs,))
        if first is None or first.shape[0] != b:
            raise self.refusal(f"its first tensor argument has shape {tuple(first.shape) if first is not None else None}"
                               f", but the micro-batch has {b} examples: the batch must be the first dimension of "
                               "its input (keep inputs as (B, T, d), batch_first=True)")
        call = _Call(self, b, leaves, spec)
        eng._register_site(self)
        outs = GenericFunction.apply(call, len(tensors), *tensors, *self.params_)
        mark_outputs(outs, Rows(b))  # batch first, as its input (token_major.py)
        return call.rebuild(outs if isinstance(outs, tuple) else (outs,))

    def verified_for(self, call: _Call) -> bool:
        return self.verified if call.rows is None else self.verified_rows

    def set_verified(self, call: _Call) -> None:
        if call.rows is None:
            self.verified = True
        else:
            self.verified_rows = True

    # ---------------------------------------------------------------- token-major calls: one example at a time
    def _example_rows(self, call: _Call):
        """Per example i, the indices of its rows (``call.rows``: the map of the split tensors)."""
        ex = call.rows.examples()
        return [torch.nonzero(ex == i).flatten() for i in range(call.examples)]

    def _one_example(self, call: _Call, params, tensors, idx):
        leaves = [t.index_select(0, idx.to(t.device)) if d == 0 else t for t, d in zip(tensors, call.in_dims)]
        return call.outputs(self.forward_with(params, call, leaves), int(idx.numel()))

    def per_example_rows(self, call: _Call, params, tensors, grads, wanted: list[bool]):
        """A token-major call's per-example parameter gradients ``(B, *p.shape)``: example i's gradient is the
        backward of the module run on example i's rows alone (its rows of every split tensor, the others whole),
        one recomputation per example (a forward with data-dependent control flow, such as an MoE's dispatch,
        cannot be vmapped); and the input gradients, each example's rows written at their place."""
        per = [torch.zeros(call.examples, *param_shape(p), dtype=torch.float32, device=p.device) for p in params]
        gin: list[Optional[torch.Tensor]] = [torch.zeros_like(t) if w else None for t, w in zip(tensors, wanted)]
        diff = [k for k, w in enumerate(wanted) if w]
        for i, idx in enumerate(self._example_rows(call)):
            if idx.numel() == 0:
                continue
            with torch.enable_grad():
                prm = [p.detach().requires_grad_(True) for p in params]
                ts = [t.detach().requires_grad_(True) if w else t for t, w in zip(tensors, wanted)]
                outs = self._one_example(call, prm, ts, idx)
                pairs = [(o, g.index_select(0, idx.to(g.device))) for o, g in zip(outs, grads)
                         if g is not None and o.requires_grad]
                if not pairs:
                    continue
                got = torch.autograd.grad([o for o, _ in pairs], [*prm, *[ts[k] for k in diff]],
                                          [g for _, g in pairs], allow_unused=True)
            for k, gp in enumerate(got[:len(prm)]):
                if gp is not None:
                    per[k][i] = gp.float()
            for k, gt in zip(diff, got[len(prm):]):
                if gt is not None:
                    gin[k] += gt
        return per, gin

    def check_forward_rows(self, call: _Call, tensors, out: list[torch.Tensor]) -> None:
        """A token-major call's proof: the module on each example's rows alone gives that example's rows of the
        batched output (a forward that mixes examples, or rows of several examples, fails)."""
        with torch.no_grad():
            params = [p.detach() for p in self.params_]
            for idx in self._example_rows(call):
                if idx.numel() == 0:
                    continue
                for o, r in zip(out, self._one_example(call, params, tensors, idx)):
                    if not _close(r, o.index_select(0, idx.to(o.device))):
                        raise self.refusal("its output for one example's rows alone differs from those rows' output "
                                           "in the batch: the forward mixes examples")

    def refusal(self, what: str) -> UnsupportedLayerError:
        names = ", ".join(self.rule.param_names)
        return UnsupportedLayerError(
            f"{type(self.module).__name__} '{self.name}' has no dedicated per-example rule, so its own parameters "
            f"({names}) are clipped by the generic rule (torch.func per example over its forward), but {what}. "
            "Fix: make its forward treat each example alone and deterministically, register a rule for it "
            "(lightning_dpzero.per_sample.register_rule), or freeze its parameters (requires_grad_(False)).")

    # ---------------------------------------------------------------- the per-example forward
    def forward_with(self, params, call: _Call, tensors, one=False):
        """The module's own forward (no module hooks) with ``params`` in place of its parameters."""
        shadow = self.module.__dict__
        names = self.rule.param_names
        try:
            for n, v in zip(names, params):
                shadow[n] = v
            args, kwargs = call.args(tensors, one)
            return self.module_forward(*args, **kwargs)
        finally:
            for n in names:
                shadow.pop(n, None)

    def per_example(self, call: _Call, params, tensors, grads, wanted: list[bool]):
        """``torch.func``: per-example parameter gradients ``(B, *p.shape)`` and the input gradients (summed
        over the examples for an input passed whole), for the tensors ``wanted``."""
        from torch.func import grad, vmap

        diff = [k for k, w in enumerate(wanted) if w]

        def one(prm, ins, gs, rest):
            full = list(rest)
            for k, t in zip(diff, ins):
                full[k] = t
            outs = call.outputs(self.forward_with(prm, call, full, one=True), 1)
            return sum((o.squeeze(0) * g).sum() for o, g in zip(outs, gs) if g is not None and o.is_floating_point())

        ins = tuple(tensors[k] for k in diff)
        dims = (None, tuple(call.in_dims[k] for k in diff), tuple(None if g is None else 0 for g in grads),
                tuple(call.in_dims))
        try:
            gp, gi = vmap(grad(one, argnums=(0, 1)), in_dims=dims, randomness="error")(
                tuple(params), ins, tuple(grads), tuple(tensors))
        except UnsupportedLayerError:
            raise
        except RuntimeError as e:
            raise self.refusal(f"torch.func could not form its per-example gradients ({_short(e)})") from e
        gin: list[Optional[torch.Tensor]] = [None] * len(tensors)
        for k, t in zip(diff, gi):
            gin[k] = t if call.in_dims[k] == 0 else t.sum(0)
        return list(gp), gin

    def check_forward(self, call: _Call, tensors, out: list[torch.Tensor]) -> None:
        """The vmapped per-example forward equals the batched one row by row (and draws no random numbers)."""
        from torch.func import vmap

        def one(prm, ts):
            return tuple(o.squeeze(0) for o in call.outputs(self.forward_with(prm, call, list(ts), one=True), 1))
        try:
            with torch.no_grad():
                rows = vmap(one, in_dims=(None, call.in_dims), randomness="error")(
                    tuple(p.detach() for p in self.params_), tuple(tensors))
        except UnsupportedLayerError:
            raise
        except RuntimeError as e:
            if "randomness" in str(e):
                raise self.refusal("its forward draws random numbers (e.g. dropout), which the recomputation in "
                                   "backward would not see again") from e
            raise self.refusal(f"torch.func could not run its forward per example ({_short(e)})") from e
        for o, r in zip(out, rows):
            if not _close(r, o):
                raise self.refusal("its output for each example alone differs from its output in the batch: the "
                                   "forward mixes examples (e.g. statistics over the batch)")

    def check_grads(self, call: _Call, params, tensors, grads, per) -> None:
        """The per-example gradients sum to the batched gradient of the same forward."""
        with torch.enable_grad():
            prm = [p.detach().requires_grad_(True) for p in params]
            outs = call.outputs(self.forward_with(prm, call, [t.detach() for t in tensors]), call.b)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            batched = torch.autograd.grad([o for o, _ in pairs], prm, [g for _, g in pairs], allow_unused=True) \
                if pairs else [None] * len(prm)
        for p, ref, pe in zip(self.rule.param_names, batched, per):
            ref = torch.zeros_like(pe[0]) if ref is None else ref
            if not _close(pe.sum(0).to(ref.dtype), ref):
                raise self.refusal(f"the per-example gradients of '{p}' do not sum to its batched gradient: the "
                                   "forward treats the batch differently from its examples one by one")


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def _versions(module: nn.Module, tensors) -> dict:
    """What a forward that keeps state, or writes into its inputs, changes: each buffer (by identity and
    version counter) and each input's version counter."""
    state = {f"its buffer '{n}'": (id(b), b._version) for n, b in module.named_buffers()}
    state.update({f"its input {k} (in place)": t._version for k, t in enumerate(tensors)})
    return state


class GenericFunction(torch.autograd.Function):
    """``outs = module(*args)``; backward returns the input gradients and the engine's clipped gradients for
    the module's parameters, from the per-example gradients of :meth:`GenericHook.per_example`.
    Inputs: ``(call, n, *tensors[n], *params)``."""

    @staticmethod
    def forward(ctx, call: _Call, n: int, *args):
        hook = call.hook
        tensors, params = list(args[:n]), list(args[n:])
        before = _versions(hook.module, tensors)
        args, kwargs = call.args(tensors)
        out = call.outputs(hook.module_forward(*args, **kwargs), call.b)
        after = _versions(hook.module, tensors)
        changed = [k for k in before if after.get(k) != before[k]]
        if changed:
            raise hook.refusal(f"its forward changes {', '.join(changed)}: state that the per-example "
                               "recomputation in backward would not see")
        # the proof, at the first call with two or more examples (it runs no collective: the module's own forward
        # only, its parameters already gathered, and under ZeRO-3 it is a leaf module: coverage.py)
        ctx.proving = not hook.verified_for(call) and call.examples >= 2
        if ctx.proving:
            (hook.check_forward if call.rows is None else hook.check_forward_rows)(call, tensors, out)
        ctx.call, ctx.n = call, n
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors, *params)
        ins = {id(t) for t in tensors}
        out = [o.clone() if id(o) in ins else o for o in out]  # an input returned as it is
        ctx.mark_non_differentiable(*[o for o in out if not o.is_floating_point()])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        call, n = ctx.call, ctx.n
        hook = call.hook
        saved = list(ctx.saved_tensors)
        tensors, params = saved[:n], saved[n:]
        wanted = [bool(ctx.needs_input_grad[2 + k]) and t.is_floating_point() for k, t in enumerate(tensors)]
        if call.examples == 0 or all(g is None for g in grads):
            per = [torch.zeros(call.examples, *param_shape(p), dtype=torch.float32, device=p.device) for p in params]
            gin: list[Any] = [torch.zeros_like(t) if w else None for t, w in zip(tensors, wanted)]
        else:
            per, gin = (hook.per_example if call.rows is None else hook.per_example_rows)(
                call, [p.detach() for p in params], [t.detach() for t in tensors], list(grads), wanted)
            if ctx.proving:
                hook.check_grads(call, params, tensors, grads, per)
                hook.set_verified(call)
        site = Site(hook, torch.empty(call.examples, 0, device=params[0].device), tuple(g.float() for g in per))
        return (None, None, *gin, *hook.engine._on_backward(site, list(params)))
