"""Values shared by every example, traced to where the forward broadcasts them over the batch.

A parameter used directly in a forward (ConvNeXt's ``layer_scale_parameter`` ``(C,)``, CLIP's
``class_embedding`` ``(d,)``) or an embedding looked up at indices with no batch dimension (nanoGPT's
``wpe(torch.arange(T))``, T5's relative attention bias on ``(L, L)`` position buckets) is the same for every
example until some operation broadcasts it against batch-first activations (``x * scale``, ``x + pos``,
``bias + mask``, ``p.expand(B, 1, -1)``). Example i's gradient of it is the backward of that operation's row
i, summed over its uses.

While the engine clips, such a value is a :class:`Shared` tensor: a ``torch.Tensor`` subclass holding its
plain value (so shapes, control flow and every operation among shared values run as written) and, through
:meth:`Shared.batched`, a per-example copy ``(B, *shape)`` whose gradient row i is example i's: for a parameter
``P``, ``P.expand(B, *P.shape)`` made by the module's autograd function (``parameters.py``); for an embedding
on shared indices, the layer run on the indices expanded to ``(B, ...)`` (its per-example rule, ``engine.py``);
for a value computed from shared values (``-torch.exp(A_log)``, ``bias.permute(2, 0, 1)[None]``), the same
operation under ``torch.func.vmap`` over their copies.

An operation is a *broadcast point* when its output has the batch in dimension 0 (``B`` rows) and each shared
input either has fewer dimensions than the output or a first dimension 1: there each shared input is replaced
by its copy shaped ``(B, 1, …, 1, *shape)`` (``(B, *shape[1:])`` for a first dimension 1), which broadcasts
exactly as the value did, and the output is an ordinary tensor with gradients. Anything else that involves a
shared value stays shared, except an operation with a tensor that needs a gradient, which is refused (that
use is not broadcast over the batch; its gradient would bypass clipping), as is ``backward`` from a shared value.

What makes the per-example gradients exact (docs/design.md, *Parameters used directly*): (1) at each broadcast
point, row i of the output reads row i of the copies only and the output equals the original one: checked once
per module by recomputing the operation with the copies of a set of examples perturbed (``CHECK_BITS`` rounds,
both sides); (2) the output's first dimension is the batch and per example: the layout check records every
broadcast point's output like a layer's input (a dimension that only happens to equal B is seen as shared);
(3) every use reaching the loss passes a broadcast point (the refusals above, and the guard on each parameter).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .base import LayerHook, UnsupportedLayerError
from .provenance import Rows, mark, rows_of

#: perturbation rounds of the once-per-module locality check of a broadcast point (2 * CHECK_BITS recomputations)
CHECK_BITS = 6


class BroadcastUse:
    """The broadcast points of one hook's shared values as the layout check records them (one per hook, so both
    of its forwards name the same caller): duck-typed as a hook, ``engine``, ``module``, ``name`` and ``rule``."""

    def __init__(self, hook):
        self.engine, self.module, self.name, self.rule = hook.engine, hook.module, hook.name, hook.rule


class Origin:
    """Where shared values come from: the hook, the micro-batch size ``b`` (``None``: the layout check, whose
    recorder is ``record``; no copies are made), and whether broadcast points are still to be checked."""

    def __init__(self, hook, b: Optional[int], check: bool = False, record: Any = None):
        self.hook, self.b, self.check, self.record = hook, b, check, record
        self.module, self.name, self.rule = hook.module, hook.name, hook.rule
        if "broadcast_use" not in hook.__dict__:
            hook.broadcast_use = BroadcastUse(hook)


class Shared(torch.Tensor):
    """A value shared by every example (see the module docstring); ``batched()``: its per-example copy."""

    @staticmethod
    def __new__(cls, value: torch.Tensor, origin: Origin, make: Optional[Callable[[], torch.Tensor]]):
        t = torch.Tensor._make_subclass(cls, value.detach(), False)
        t._origin, t._make, t._copy, t._zero3 = origin, make, None, None
        return t

    def batched(self) -> torch.Tensor:
        if self._copy is None:
            self._copy = self._make()
        return self._copy

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat_args = tree_flatten((args, kwargs))[0]
        shared = [a for a in flat_args if isinstance(a, Shared)]
        origin = shared[0]._origin
        if func is torch.Tensor.backward:
            raise _refusal(origin, "the loss is computed from it without broadcasting it over the batch")
        if _in_place(func):  # before it runs: it would write the parameter, or apply twice at a broadcast
            raise _refusal(origin, f"an in-place operation ({func.__name__}) involves it: write it out of place "
                                   "(x = x + p, not x += p)")
        if func is torch.Tensor.detach and _in_zero3_output_hook():
            return _zero3_wrapped(shared[0])
        others = [a for a in flat_args if isinstance(a, torch.Tensor) and not isinstance(a, Shared)]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*tree_map(_plain, args), **tree_map(_plain, kwargs))
            if not isinstance(out, (torch.Tensor, tuple, list)):
                return out  # a shape, a dtype, a Python number
            b = origin.b if origin.b is not None else (origin.record.rows if origin.record is not None else None)
            if isinstance(out, torch.Tensor) and (rows := _broadcast_point(func, out, shared, others, b)) is not None:
                return _at_broadcast(func, args, kwargs, out, shared, origin, b, rows)
            if any(a.requires_grad for a in others) and torch.is_grad_enabled():
                raise _refusal(origin, f"{getattr(func, '__name__', func)} combines it with a tensor that has a "
                                       "gradient without broadcasting it over the batch (the output's first dimension "
                                       "is not the micro-batch)")
        flat, spec = tree_flatten(out)
        made = [Shared(o, origin, _derived(func, args, kwargs, shared, k)) if isinstance(o, torch.Tensor)
                and o.is_floating_point() else o for k, o in enumerate(flat)]
        return spec.unflatten(made) if not isinstance(out, torch.Tensor) else made[0]


_IN_PLACE_DUNDERS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or",
                                               "xor", "lshift", "rshift", "matmul")} | {"__setitem__"}


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("_")) or name in _IN_PLACE_DUNDERS


def _plain(a):
    return a.as_subclass(torch.Tensor) if isinstance(a, Shared) else a


#: operations that broadcast a shared value over the batch with no batch-first operand (CLIP's
#: ``class_embedding.expand(B, 1, -1)``)
_EXPANSIONS = {"expand", "broadcast_to", "repeat"}


def _broadcast_point(func, out: torch.Tensor, shared: list, others: list, b: Optional[int]) -> Optional[Rows]:
    """Whether ``out`` is a broadcast point, as its rows' examples (``None``: it is none). Its rows are the examples,
    ``Rows(b)``, where its first dimension is the micro-batch and it is computed with a batch-first floating
    operand or by an expansion (``_EXPANSIONS``; a reshape of Swin's bias table to ``(N, N, heads)`` is none when
    N equals B); else they are the row map of an operand of as many dimensions whose first dimension is the
    output's rows (token-major rows ``(B·m, ...)``: Swin's ``(B·windows, heads, N, N)`` attention scores,
    ``provenance.py``). Each shared input must have fewer dimensions than the output or a first dimension 1; with
    token-major rows it may also have the output's rows, aligned with them (:func:`_row_aligned`: Swin's bias
    plus its shifted-window mask, ``(B·windows, heads, N, N)``, the same for every example)."""
    if b is None or out.dim() < 1:
        return None
    rows = None
    if out.shape[0] == b and (getattr(func, "__name__", "") in _EXPANSIONS or any(
            t.is_floating_point() and t.dim() >= 1 and t.shape[0] == b for t in others)):
        rows = Rows(b)  # against batch-first activations, or expanded: not a reshape whose first dimension is b
    for t in others if rows is None else ():
        mapped = rows_of(t)
        if mapped is not None and mapped.b == b and t.dim() == out.dim() and t.shape[0] == mapped.rows == out.shape[0]:
            rows = mapped
            break
    if rows is None:
        return None
    if _per_example_op(func, shared, out.dim(), rows):
        return rows
    for s in shared:
        if not (s.dim() < out.dim() or s.shape[0] == 1 or (_token_major(rows) and _row_aligned(func, s, out))):
            return None
    return rows


#: convolutions, which take a shared value as a weight (Mamba's ``F.conv1d(h, conv1d.weight.unsqueeze(1), bias,
#: groups=C)``) rather than broadcasting it: at a broadcast point with batch-first rows each example's output is the
#: convolution of that example alone with its own copy (:func:`_vmapped`). A weight matrix (``F.linear(h, w)``)
#: stays refused: put it in an ``nn.Linear``
_WEIGHT_OPS = {torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d}


def _per_example_op(func, shared: list, out_dim: int, rows: Rows) -> bool:
    """``func`` takes a shared value as a weight that does not broadcast over the batch (:data:`_WEIGHT_OPS`), on
    batch-first rows (one per example: not token-major)."""
    return func in _WEIGHT_OPS and not _token_major(rows) and any(
        not (s.dim() < out_dim or s.shape[0] == 1) for s in shared)


def _token_major(rows: Rows) -> bool:
    return not (rows.blocks and rows.m == 1)


def _row_aligned(func, s: torch.Tensor, out: torch.Tensor) -> bool:
    """Row r of ``out`` reads row r of ``s`` only: ``s`` has the output's rows and broadcasts to its shape
    (elementwise operations), or is the attention mask of ``scaled_dot_product_attention``."""
    if s.dim() != out.dim() or s.shape[0] != out.shape[0]:
        return False
    if func is torch.nn.functional.scaled_dot_product_attention:
        return True
    try:
        return tuple(torch.broadcast_shapes(s.shape, out.shape)) == tuple(out.shape)
    except RuntimeError:
        return False


def layout_copy(value: torch.Tensor, record) -> Callable[[], torch.Tensor]:
    """In the layout check (``record``: its recorder, ``record.index`` the pass's re-indexing or ``None``), the
    copy of a shared value: ``value`` plus a fixed tag per example, ``(B, *shape)``, row i tagged as the example it
    holds. A value whose copies reach the wrong examples (broadcast along a dimension that only equals B) then
    moves the inputs of the layers after it unlike their examples, which the check refuses; plain copies,
    all equal, would move with any re-indexing."""
    def make():
        b = record.b
        tags = torch.randn((b, *value.shape), generator=torch.Generator().manual_seed(1), dtype=torch.float32)
        order = torch.arange(b) if getattr(record, "index", None) is None else record.index.cpu()
        scale = 0.1 * (float(value.detach().float().abs().mean()) + 1e-3) if value.numel() else 0.0
        return value.detach() + (tags[order] * scale).to(value.device, value.dtype)
    return make


def _derived(func, args, kwargs, shared: list, k: int) -> Callable[[], torch.Tensor]:
    """The copy of output ``k`` of ``func``: ``func`` under vmap over the copies of its shared inputs."""
    def make():
        copies = [s.batched() for s in shared]

        def one(*rows):
            sub = dict((id(s), r) for s, r in zip(shared, rows))
            a, kw = tree_map(lambda t: sub.get(id(t), t) if isinstance(t, Shared) else t, (args, kwargs))
            return tree_flatten(func(*a, **kw))[0][k]
        with torch._C.DisableTorchFunctionSubclass():
            return torch.func.vmap(one)(*copies)
    return make


def _shaped(copy: torch.Tensor, s: torch.Tensor, out_dim: int) -> torch.Tensor:
    """``copy`` ``(B, *s.shape)`` as it broadcasts in place of ``s`` against a batch-first output of ``out_dim``
    dimensions: ``(B, 1, …, 1, *s.shape)``, or ``(B, *s.shape[1:])`` for a first dimension 1."""
    if s.dim() < out_dim:
        return copy.reshape(copy.shape[0], *[1] * (out_dim - 1 - s.dim()), *s.shape)
    return copy.reshape(copy.shape[0], *s.shape[1:])


def _row_copies(copy: torch.Tensor, s: torch.Tensor, out_dim: int, ex: torch.Tensor) -> torch.Tensor:
    """Token-major rows ``ex`` (each row's example): row r of ``s``'s substitute is example ex[r]'s copy (its
    row r where ``s`` has the output's rows)."""
    if s.dim() == out_dim and s.shape[0] == ex.shape[0] and s.shape[0] != 1:
        return copy[ex, torch.arange(ex.shape[0], device=ex.device)]
    return _shaped(copy, s, out_dim).index_select(0, ex)


def _substituted(func, args, kwargs, shared: list, copies: list, out_dim: int, rows: Rows):
    """``func`` with each shared value replaced by its copy, row r of the output reading the copy of its example
    (``rows``: index_select's backward sums each example's rows into its copy's gradient)."""
    if _per_example_op(func, shared, out_dim, rows):
        return _vmapped(func, args, kwargs, shared, copies, rows.b)
    ex = rows.examples(copies[0].device) if _token_major(rows) else None
    sub = {id(s): _shaped(c, s, out_dim) if ex is None else _row_copies(c, s, out_dim, ex)
           for s, c in zip(shared, copies)}
    a, kw = tree_map(lambda t: sub[id(t)] if isinstance(t, Shared) else t, (args, kwargs))
    with torch._C.DisableTorchFunctionSubclass():
        return func(*a, **kw)


def _vmapped(func, args, kwargs, shared: list, copies: list, b: int) -> torch.Tensor:
    """``func`` once per example under ``torch.func.vmap``: its batch-first tensors (first dimension ``b``) as that
    example alone (a batch of one), each shared value as the example's copy, other tensors whole."""
    flat, spec = tree_flatten((args, kwargs))
    sub = {id(s): c for s, c in zip(shared, copies)}
    slots = [k for k, a in enumerate(flat) if isinstance(a, Shared) or (
        isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[0] == b)]

    def one(*tensors):
        leaves = list(flat)
        for k, t in zip(slots, tensors):
            leaves[k] = t if isinstance(flat[k], Shared) else t.unsqueeze(0)
        a, kw = tree_unflatten(leaves, spec)
        return func(*a, **kw).squeeze(0)
    with torch._C.DisableTorchFunctionSubclass():
        return torch.func.vmap(one)(*[sub[id(flat[k])] if isinstance(flat[k], Shared) else _plain(flat[k])
                                      for k in slots])


def _at_broadcast(func, args, kwargs, out: torch.Tensor, shared: list, origin: Origin, b: int, rows: Rows
                  ) -> torch.Tensor:
    """The broadcast point: the output computed from the per-example copies (see the module docstring); in the
    layout check, that output (of tagged copies), recorded."""
    copies = [s.batched() for s in shared]
    res = _substituted(func, args, kwargs, shared, copies, out.dim(), rows)
    if origin.b is None:  # the layout check: this output must be batch first (or its rows mapped) and per example
        if _token_major(rows):
            mark(res, rows)
        origin.record.record(origin.hook.broadcast_use, (res,), {})
        return res
    if origin.check and b >= 2:
        _check(func, args, kwargs, out, res, shared, copies, origin, b, rows)
    return res


def _check(func, args, kwargs, out, res, shared, copies, origin, b, rows) -> None:
    """Once per module: the output equals the original, and perturbing the copies of a set S of examples changes
    no row outside S (for S and its complement on each of ``CHECK_BITS`` bits of a fixed permutation)."""
    if not isinstance(res, torch.Tensor) or res.shape != out.shape or not torch.allclose(
            res.detach().float(), out.float(), rtol=1e-4, atol=1e-6):
        raise _refusal(origin, f"{getattr(func, '__name__', func)} gives another output with one copy per example")
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(b, generator=gen)
    with torch.no_grad():
        for bit in range(CHECK_BITS):
            for side in (0, 1):
                chosen = ((order >> bit) & 1) == side
                moved = []
                for c in copies:
                    noise = torch.randn(c.shape, generator=gen).to(c.device, c.dtype)
                    scale = c.detach().float().abs().mean() + 1
                    moved.append(c.detach() + noise * scale * chosen.to(c.device).view(-1, *[1] * (c.dim() - 1)))
                new = _substituted(func, args, kwargs, shared, moved, out.dim(), rows)
                keep = (~chosen).to(out.device)[rows.examples(out.device)]
                if not torch.allclose(new[keep].float(), res.detach()[keep].float(), rtol=1e-4, atol=1e-6):
                    raise _refusal(origin, f"in {getattr(func, '__name__', func)} an example's output reads another "
                                           "example's copy")


def _refusal(origin: Origin, what: str) -> UnsupportedLayerError:
    return UnsupportedLayerError(
        f"{type(origin.module).__name__} '{origin.name}': {list(origin.rule.param_names)} are used directly in the "
        f"forward, shared by every example until an operation broadcasts them over the batch, and {what}. "
        "Per-example gradients exist only for such broadcast uses: compute that use from batch-first tensors, "
        "move it into a supported layer (nn.Linear, nn.Embedding), or freeze the parameter "
        "(requires_grad_(False)).")


def on_shared_indices(engine, hook, x: Any, extra: tuple[tuple, dict]) -> Optional[Any]:
    """A layer that looks indices up (``broadcast_batch`` rules: ``nn.Embedding``) called on indices with no
    batch dimension (``(T,)``, or a first dimension that is neither 1 nor B: T5's ``(L, L)`` buckets): its
    output as a shared value, whose per-example copy is the layer run on the indices expanded to ``(B, ...)``
    (its own rule clips it); ``None`` for any other call. Once a layer has been called so, every call of it is
    (its indices do not follow the examples; a later B equal to L must not make them look batch first). In the
    layout check its broadcast points are recorded instead of its indices."""
    layout = engine._layout
    b = engine.expected_batch_size if layout is None else layout.rows
    if not hook.__dict__.get("shared_indices"):
        if (not hook.rule.broadcast_batch or not isinstance(x, torch.Tensor) or x.is_floating_point() or b is None
                or (x.dim() >= hook.rule.min_input_dim and x.shape[0] in (1, b))
                or rows_of(x) is not None):  # the examples' tokens as rows, (B·T,) or gathered: token_major.py
            return None
        hook.shared_indices = True
    if not engine.clipping_now():
        if layout is None:
            return hook.original_forward(x, extra)
        value = hook.original_forward(x, extra)
        return Shared(value, Origin(hook, None, record=layout), layout_copy(value, layout))
    rows = x.expand(b, *x.shape)
    engine._register_site(hook)
    engine.input_readers.add(rows)
    copy = hook.run(rows, hook.rule.params(hook.module), extra)  # (B, *x.shape, d): example i's in row i
    origin = Origin(hook, b, check=not hook.__dict__.get("verified"))
    hook.verified = hook.__dict__.get("verified") or b >= 2
    value = Shared(copy[0], origin, lambda: copy)
    gathered_in_backward(value, hook)
    return value


def gathered_in_backward(out: Any, hook) -> None:
    """Under ZeRO-3, each shared value in ``out`` (a layer's output: an embedding's on shared indices, an
    input-free module's such as Swin's relative position bias) gets its copy through the layer's own DeepSpeed
    ``pre_bwd_fn`` when DeepSpeed's hook after the forward passes it (:func:`_zero3_wrapped`): the copy is
    broadcast, and its gradient reaches the layer's site, after the layer's forward, when ZeRO-3 has partitioned
    the layer's parameters; that function's backward gathers them before the site returns their clipped sums.
    Elsewhere nothing."""
    if not (_zero3(hook) and hasattr(hook.module, "pre_bwd_fn")):
        return
    for value in tree_flatten(out)[0]:
        if isinstance(value, Shared):
            value._zero3 = hook.module  # DeepSpeed's forward hook is next: _zero3_wrapped


def mark_shared_indices(failures: list) -> set:
    """The layout check's layers looking indices up (``nn.Embedding``) whose indices came out the same whatever
    the examples (``"shared"``: T5's ``(L, L)`` buckets when L equals B, which only their shape made look batch
    first): marked, so that every later call of them, the check's next run included, is a shared value."""
    marked = {h for h, cause in failures if cause == "shared" and isinstance(h, LayerHook) and h.rule.broadcast_batch}
    for h in marked:
        h.shared_indices = True
    return marked


#: the autograd functions ZeRO-3's hooks apply to each output (before its backward: gather the module's weights)
#: and each positional input (after its backward: release them) of a module; their forward is ``x.detach()``
_ZERO3_HOOK_FORWARDS = ("PreBackwardFunctionForModule.forward", "PostBackwardFunctionModule.forward")


def _in_zero3_output_hook() -> bool:
    """The caller of ``detach`` (this function's caller's caller: ``detach`` is a C method; past the handlers of
    this package between them, such as the token-major row tracker's mode, ``provenance.py``) is the forward of one
    of ZeRO-3's hook functions (``_ZERO3_HOOK_FORWARDS``, DeepSpeed's ``parameter_offload.py``)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE) and frame.f_code.co_name == \
            "__torch_function__":
        frame = frame.f_back
    code = frame.f_code if frame is not None else None
    return code is not None and "deepspeed" in code.co_filename and code.co_qualname.endswith(_ZERO3_HOOK_FORWARDS)


#: this package's folder: frames of its torch-function handlers are skipped by :func:`_in_zero3_output_hook`
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _zero3_wrapped(value: Shared) -> Shared:
    """ZeRO-3's hook after a module's forward passes each output through DeepSpeed's ``pre_bwd_fn`` (forward:
    ``output.detach()``; backward: gather the module's weights, then pass the gradient on), and its hook before
    the forward each positional input through ``post_bwd_fn`` (T5's position bias, handed from block to block). A
    shared value's gradient does not flow through the value but through its copy, made later at the broadcast
    point: the detach would cut it (silently: the parameter would get no gradient). So a shared value that enters
    or leaves a module keeps its copy; and the output of the layer that looked up shared indices (``value._zero3``: that layer, consumed once)
    gets a copy through the layer's own ``pre_bwd_fn``, so that its backward gathers the weight before the site's
    backward returns the clipped sum to it, as for any layer."""
    module, value._zero3 = value._zero3, None
    if module is None:
        return Shared(_plain(value), value._origin, value.batched)
    return Shared(_plain(value), value._origin, lambda: module.pre_bwd_fn.apply(value.batched()))


def _zero3(hook) -> bool:
    """The layer's trainable parameters are ZeRO-3's (partitioned outside its forward and backward)."""
    return any(hasattr(p, "ds_id") for p in hook.rule.params(hook.module) if p is not None and p.requires_grad)
