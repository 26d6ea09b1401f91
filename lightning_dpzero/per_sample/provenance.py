"""Row provenance: which example each row of a token-major activation belongs to (docs/design.md, *Token-major
layers*).

Some models hand a layer its tokens as rows, ``(B·T, d)``, instead of batch first: OPT's feed-forward block
(``hidden_states.reshape(-1, d)``), every Hugging Face mixture of experts (router and experts get the flattened
tokens), Swin's window attention (``view → permute → view`` gives rows = (example, window)). Each row still
belongs to one example, so per-example gradients exist: example i's gradient is the sum over its rows.

While the engine clips (and while the layout check records), :class:`RowTracker`, a ``TorchFunctionMode``,
follows a *row map* from batch-first tensors to what is computed from them. A map is :class:`Rows`: B examples
and, for each row along dimension 0, its example: ``row // m`` for contiguous equal blocks (``m`` rows per
example, ``m = 1``: batch first) or an index tensor (rows gathered by an index, as an MoE dispatch does). It is
carried, per tensor, through

* ``view``/``reshape``/``flatten``/``unflatten``: row R of the output is elements ``R·K .. R·K+K-1`` of the input
  (K its row length); the map survives where each output row lies within one example (merging the batch with
  the following dimensions, or splitting rows of one example);
* indexing along dimension 0 (``t[idx]``, ``t[a:b]``, ``t[idx, col]``, ``index_select(t, 0, idx)``): the map indexed alike; a
  table indexed by a mapped index (``table[ids]``) gets the index's map;
* operations that keep dimension 0 as it is: elementwise ones (every other operand broadcast, or of the same
  map), reductions, softmax, ``topk``, ``cat``/``chunk``/``split`` along another dimension, ``permute`` and
  ``transpose`` that leave dimension 0 first, ``matmul`` of two operands with the same map or of a mapped
  operand by a shared matrix, ``linear``, ``layer_norm``, ``pad`` of other dimensions, convolutions and pooling
  of a batched input (a frozen patch embedding: Swin's with LoRA).

An operation on a mapped tensor that is none of these marks its output *lost* with the operation's name: a
layer whose input's first dimension is not the micro-batch and that carries such a mark is refused with that
name (never a guess). Seeds: every layer input whose first dimension is the micro-batch, and every layer output
(whose rows are its input's). The map is formed per forward (an MoE's routing differs per micro-batch); the
layout check proves it before the first update by the same re-indexing and single-example forwards that prove
a batch-first layout (``layout.py``: each example's rows are compared as that example's row).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_ATTR = "_dp_rows"


class Rows:
    """A row map: ``b`` examples; row r of dimension 0 belongs to example ``r // m`` (``index is None``) or to
    example ``index[r]`` (a LongTensor of the rows' examples)."""

    __slots__ = ("b", "m", "index")

    def __init__(self, b: int, m: int = 1, index: Optional[torch.Tensor] = None):
        self.b, self.m, self.index = int(b), int(m), index

    @property
    def rows(self) -> int:
        return self.b * self.m if self.index is None else int(self.index.shape[0])

    @property
    def blocks(self) -> bool:
        """Contiguous equal blocks: a plain reshape of ``(B, m, ...)``."""
        return self.index is None

    def examples(self, device=None) -> torch.Tensor:
        """The example of each row, ``(rows,)`` int64."""
        if self.index is not None:
            return self.index
        return torch.arange(self.b, device=device).repeat_interleave(self.m)

    def same(self, other: "Rows") -> bool:
        if self is other:
            return True
        if self.b != other.b or self.rows != other.rows:
            return False
        if self.index is None and other.index is None:
            return self.m == other.m
        return torch.equal(self.examples().cpu(), other.examples().cpu())

    def __repr__(self) -> str:
        return f"Rows(b={self.b}, m={self.m})" if self.index is None else f"Rows(b={self.b}, gathered {self.rows})"


class Lost:
    """The mark of a tensor computed from a mapped one by an operation the tracker does not follow."""

    __slots__ = ("op",)

    def __init__(self, op: str):
        self.op = op


class Broadcast:
    """The mark of a value with no rows of its own: expanded from a first dimension of 1 (or from fewer
    dimensions), e.g. Swin's window mask ``mask[None].expand(B, ...).reshape(B·windows, ...)``; combined with mapped
    rows it broadcasts as a ``(1, ...)`` operand does (whose independence of the examples the layout check tests)."""

    __slots__ = ()


_BROADCAST = Broadcast()


def rows_of(t: Any) -> Optional[Rows]:
    """The row map of ``t`` (``None``: none, or lost)."""
    r = getattr(t, _ATTR, None) if isinstance(t, torch.Tensor) else None
    return r if isinstance(r, Rows) else None


def lost_at(t: Any) -> Optional[str]:
    """The operation at which the row map of ``t`` was lost, if it was."""
    r = getattr(t, _ATTR, None) if isinstance(t, torch.Tensor) else None
    return r.op if isinstance(r, Lost) else None


def mark(t: Any, rows: Any) -> None:
    """Attach ``rows`` (a :class:`Rows` or :class:`Lost`) to tensor ``t``."""
    if isinstance(t, torch.Tensor):
        try:
            object.__setattr__(t, _ATTR, rows)
        except (AttributeError, TypeError):  # a tensor type without an instance dict
            pass


def seed(t: Any, b: Optional[int]) -> None:
    """Mark ``t`` batch first (``m = 1``) where its first dimension is ``b`` examples and it has no map yet."""
    if b is not None and isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == b and rows_of(t) is None:
        mark(t, Rows(b))


def by_example(t: torch.Tensor, rows: Rows) -> Any:
    """``t`` (rows along dimension 0) grouped per example: ``(B, m·…)`` for blocks, else a list of B tensors
    (example i's rows, in order) as the layout check compares a ragged input."""
    if rows.blocks:
        return t.reshape(rows.b, rows.m, *t.shape[1:])
    ex = rows.examples(t.device)
    return [t[ex == i] for i in range(rows.b)]


# ------------------------------------------------------------------------------------------------ propagation
_SAME = {  # elementwise, or otherwise one output row from the same input row
    "add", "sub", "mul", "div", "true_divide", "pow", "neg", "exp", "log", "log1p", "expm1", "tanh", "sigmoid",
    "relu", "gelu", "silu", "mish", "softplus", "elu", "selu", "leaky_relu", "hardtanh", "sqrt", "rsqrt", "abs",
    "clamp", "clip", "where", "masked_fill", "dropout", "to", "type", "float", "half", "bfloat16", "double",
    "contiguous", "clone", "detach", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
    "type_as", "square", "erf", "sin", "cos", "reciprocal", "sign", "round", "floor", "ceil", "eq", "ne", "gt",
    "lt", "ge", "le", "logical_not", "logical_and", "logical_or", "bitwise_not", "one_hot", "nan_to_num",
    "add_", "sub_", "mul_", "div_", "masked_fill_", "clamp_", "copy_", "requires_grad_", "float_power", "maximum",
    "minimum", "lerp", "addcmul", "addcdiv", "dropout1d", "dropout2d", "alpha_dropout", "cpu", "cuda",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__rtruediv__", "__itruediv__", "__pow__", "__rpow__", "__neg__", "__eq__", "__ne__",
    "__gt__", "__lt__", "__ge__", "__le__", "__and__", "__or__", "__invert__", "__xor__", "__floordiv__",
    "__mod__", "__abs__",
}
#: operations along a dimension: (position of the dimension argument among the positional ones, its keyword,
#: its default); the map survives where the dimension is not 0 (``None``: every dimension)
_ALONG = {
    "softmax": (1, "dim", None), "log_softmax": (1, "dim", None), "sum": (1, "dim", None),
    "mean": (1, "dim", None), "amax": (1, "dim", None), "amin": (1, "dim", None), "max": (1, "dim", None),
    "min": (1, "dim", None), "norm": (2, "dim", None), "topk": (2, "dim", -1), "sort": (1, "dim", -1),
    "argsort": (1, "dim", -1), "argmax": (1, "dim", None), "argmin": (1, "dim", None),
    "cumsum": (1, "dim", None), "cumprod": (1, "dim", None), "logsumexp": (1, "dim", None),
    "chunk": (2, "dim", 0), "split": (2, "dim", 0), "narrow": (1, "dim", None), "flip": (1, "dims", None),
    "roll": (2, "dims", None), "var": (1, "dim", None), "std": (1, "dim", None), "prod": (1, "dim", None),
    "any": (1, "dim", None), "all": (1, "dim", None), "unsqueeze": (1, "dim", None),
    "squeeze": (1, "dim", None), "gather": (1, "dim", None), "cat": (1, "dim", 0), "concat": (1, "dim", 0),
    "stack": (1, "dim", 0), "unbind": (1, "dim", 0), "normalize": (2, "dim", 1), "transpose": (1, "dim0", None),
    "swapaxes": (1, "axis0", None), "repeat_interleave": (2, "dim", None), "unflatten": (1, "dim", None),
}
_SECOND_DIM = {"transpose": (2, "dim1"), "swapaxes": (2, "axis1")}
_RESHAPE = {"view", "reshape", "flatten", "view_as", "reshape_as", "unflatten", "ravel"}
_MATMUL = {"matmul", "__matmul__", "bmm", "baddbmm", "scaled_dot_product_attention", "linear", "embedding"}
#: ops over the spatial dimensions of a batched (N, C, *spatial) input: each output row from its own input row
_SPATIAL = {f"{op}{n}d" for n in (1, 2, 3) for op in ("conv", "conv_transpose", "avg_pool", "max_pool", "lp_pool",
                                                      "adaptive_avg_pool", "adaptive_max_pool")}
_IGNORED = {"__get__", "__set__", "dim", "size", "numel", "__len__", "__bool__", "item", "tolist", "__repr__",
            "__format__", "is_floating_point", "data_ptr", "stride", "element_size", "is_contiguous",
            "backward", "register_hook", "retain_grad", "_is_view"}


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _any_marked(args, kwargs) -> bool:
    """Whether an argument (or a tensor in a list or tuple argument) carries a mark: the per-op fast path."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if _ATTR in a.__dict__:
                return True
        elif isinstance(a, (list, tuple)):
            if any(isinstance(t, torch.Tensor) and _ATTR in t.__dict__ for t in a):
                return True
    return False


def _dim(func, args, kwargs, pos: int, key: str, default) -> Any:
    return kwargs[key] if key in kwargs else args[pos] if len(args) > pos else default


def _touches_zero(dims: Any, ndim: int) -> bool:
    """Whether the dimension argument ``dims`` (an int, a sequence, or ``None``: every dimension) includes 0."""
    if dims is None:
        return True
    if isinstance(dims, (list, tuple, torch.Size)):
        return any(_touches_zero(d, ndim) for d in dims) if dims else True
    if isinstance(dims, str):  # a named dimension
        return True
    return int(dims) % max(ndim, 1) == 0


def _reshaped(rows: Rows, t: torch.Tensor, out: torch.Tensor) -> Optional[Rows]:
    """The map of ``out``, a reshape of ``t`` (same elements, row-major): row R of ``out`` is elements
    ``R·K .. R·K+K-1``; it stays within one example iff (blocks) the example's ``m·K_in`` elements are a
    multiple of K, or (gathered) K divides K_in or is a multiple of it with each group of rows one example's."""
    if out.dim() < 1 or out.dtype != t.dtype or out.numel() != t.numel() or t.dim() < 1:
        return None
    k_in, k = math.prod(t.shape[1:]), math.prod(out.shape[1:])
    if k == 0 or k_in == 0:
        return rows if out.shape[0] == rows.rows else None
    if rows.blocks:
        per_example = rows.m * k_in
        return Rows(rows.b, per_example // k) if per_example % k == 0 else None
    if k_in % k == 0:
        return Rows(rows.b, index=rows.index.repeat_interleave(k_in // k))
    if k % k_in == 0:
        groups = rows.index.view(-1, k // k_in)
        return Rows(rows.b, index=groups[:, 0]) if bool((groups == groups[:, :1]).all()) else None
    return None


def _indexed(rows: Rows, key: Any, out: torch.Tensor) -> Optional[Rows]:
    """The map of ``t[key]`` where ``t`` has ``rows``: ``key``'s first entry indexes dimension 0 (a full slice,
    a slice, or a 1-D integer or boolean index), the others (slices, integers, ``...``) other dimensions."""
    keys = key if isinstance(key, tuple) else (key,)
    if not keys:
        return None
    first = keys[0]
    if isinstance(first, torch.Tensor) and first.dim() == 1 and first.dtype != torch.bool:
        # with other 1-D integer indices of the same length (a value per row picked by a column index, Mixtral's
        # top_k_weights[token_idx, top_k_pos, None]) dimension 0 of the output is still the first index's: the
        # indices broadcast to its length, in front whether or not they are adjacent
        if not all(k.dim() == 1 and k.shape == first.shape and not k.is_floating_point() and k.dtype != torch.bool
                   for k in keys[1:] if isinstance(k, torch.Tensor)):
            return None
    elif any(k is None or isinstance(k, torch.Tensor) for k in keys[1:]):
        return None
    if first is Ellipsis:
        if sum(k is not Ellipsis for k in keys[1:]) >= out.dim() + 1:  # the ellipsis covers no dimension
            return None
        first = slice(None)
    if isinstance(first, slice):
        if first == slice(None):
            return rows if out.dim() >= 1 and out.shape[0] == rows.rows else None
        ex = rows.examples()[first]
    elif isinstance(first, torch.Tensor) and first.dim() == 1 and not first.is_floating_point():
        ex = rows.examples(first.device)[first.to(torch.long) if first.dtype != torch.bool else first]
    else:
        return None
    return Rows(rows.b, index=ex) if out.dim() >= 1 and out.shape[0] == ex.shape[0] else None


class RowTracker(TorchFunctionMode):
    """The mode that carries row maps (module docstring); entered by the engine around each clipped forward (and
    each forward of the layout check), for every op a Python call away (its cost: one dispatch per op)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _any_marked(args, kwargs):
            if func is torch.Tensor.expand and isinstance(out, torch.Tensor) and out.dim() >= 1 and (
                    args[0].dim() < out.dim() or args[0].shape[0] == 1):  # a value with no rows, expanded
                mark(out, _BROADCAST)
            return out
        name = _name(func)
        if name in _IGNORED:
            return out
        if name == "__setitem__":  # t[key] = value in place: t keeps its map only where value has no rows
            value = args[2] if len(args) > 2 else None
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.numel() > 1 and (
                    getattr(args[0], _ATTR, None) is not None or getattr(value, _ATTR, None) is not None):
                mark(args[0], Lost("__setitem__"))
            return out
        ins = _tensors((args, kwargs))
        marks = [(t, getattr(t, _ATTR, None)) for t in ins]
        marks = [(t, r) for t, r in marks if r is not None]
        if not marks:
            return out
        outs = _tensors(out)
        if not outs:
            return out
        lost = next((r for _, r in marks if isinstance(r, Lost)), None)
        mapped = [(t, r) for t, r in marks if isinstance(r, Rows)]
        if not mapped and lost is None:  # broadcast values, and unmarked ones that broadcast: still no rows
            top = max(t.dim() for t, _ in marks)
            rowless = all(t.dim() == 0 or t.dim() < top or t.shape[0] == 1 for t in ins if t.__dict__.get(_ATTR) is None)
            for o in outs:
                mark(o, _BROADCAST if rowless else None)  # else: rows the tracker knows nothing of
            return out
        try:
            new = lost if not mapped else self._propagate(name, func, args, kwargs, ins, mapped, outs)
        except Exception:  # noqa: BLE001 - an argument form the rules do not know: the map is lost, never a crash
            new = None
        if new is None:
            new = Lost(name)
        for o in outs:
            if o.dim() >= 1 or isinstance(new, Lost):
                mark(o, new)
        return out

    def _propagate(self, name, func, args, kwargs, ins, mapped, outs) -> Optional[Rows]:
        t0, r0 = mapped[0]
        if name in _RESHAPE:
            if len(outs) != 1 or t0 is not ins[0]:
                return None
            return _reshaped(r0, t0, outs[0])
        if name == "__getitem__":
            if t0 is ins[0]:
                return _indexed(r0, args[1], outs[0])
            # an unmapped table indexed by a mapped index: the output's rows are the index's
            first = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
            return r0 if first is t0 and outs[0].dim() >= 1 and outs[0].shape[0] == r0.rows else None
        if name in ("index_select", "index_add", "index_add_", "index_copy", "index_copy_"):
            return self._index_op(name, args, kwargs, ins, mapped, outs)
        if name == "permute":
            dims = args[1:] if len(args) > 1 and not isinstance(args[1], (list, tuple)) else (
                args[1] if len(args) > 1 else kwargs.get("dims"))
            return r0 if t0 is ins[0] and dims is not None and int(dims[0]) % t0.dim() == 0 else None
        if name in ("expand", "repeat"):
            return r0 if t0 is ins[0] and all(o.shape[0] == r0.rows for o in outs) else None
        if name == "group_norm":  # per row, over its channel groups
            return self._same(ins, mapped, outs, r0) if t0 is ins[0] else None
        if name in ("pad", "layer_norm", "rms_norm"):
            spec = _dim(func, args, kwargs, 1, "pad" if name == "pad" else "normalized_shape", ())
            spec = (spec,) if isinstance(spec, int) else spec
            covered = len(spec) // 2 if name == "pad" else len(spec)
            ok = t0 is ins[0] and covered < t0.dim()
            return r0 if ok and all(r.same(r0) for _, r in mapped) else None
        if name in _MATMUL:
            return self._matmul(name, ins, mapped, outs)
        if name in _SPATIAL:  # batched only (an unbatched input's first dimension is its channels); weights shared
            ok = t0 is ins[0] and len(mapped) == 1 and t0.dim() == int(name[-2]) + 2
            return r0 if ok and all(o.dim() >= 1 and o.shape[0] == r0.rows for o in outs) else None
        if name in _ALONG:
            pos, key, default = _ALONG[name]
            if name in ("cat", "concat", "stack"):  # (tensors, dim)
                pos, default = 1, 0
            dims = _dim(func, args, kwargs, pos, key, default)
            if name in _SECOND_DIM:
                dims = [dims, _dim(func, args, kwargs, *_SECOND_DIM[name], None)]
            if isinstance(dims, torch.Tensor):  # torch.max(a, b) and the like: elementwise
                return self._same(ins, mapped, outs, r0)
            if name == "squeeze" and dims is None and r0.rows > 1:  # size-1 dimensions, which the rows' is not
                return self._same(ins, mapped, outs, r0)
            if name == "unflatten" and dims is not None and int(dims) % t0.dim() == 0:
                return _reshaped(r0, t0, outs[0]) if len(outs) == 1 else None
            if _touches_zero(dims, t0.dim()):
                return None
            return self._same(ins, mapped, outs, r0)
        if name in _SAME:
            return self._same(ins, mapped, outs, r0)
        return None

    @staticmethod
    def _same(ins, mapped, outs, r0: Rows) -> Optional[Rows]:
        """Dimension 0 kept as it is: every output has the rows first; every input with as many dimensions as an
        output and more than one row has the same map (another operand broadcasts: fewer dimensions, or one row)."""
        if any(o.dim() < 1 or o.shape[0] != r0.rows for o in outs):
            return None
        if any(not r.same(r0) for _, r in mapped):
            return None
        ids = {id(t) for t, _ in mapped} | {id(t) for t in ins if isinstance(getattr(t, _ATTR, None), Broadcast)}
        top = max(o.dim() for o in outs)
        batch_first = r0.blocks and r0.m == 1  # an unmapped operand with the batch first is per example too (a mask)
        for t in ins:
            if id(t) not in ids and t.dim() >= top and t.dim() >= 1 and t.shape[0] != 1 and not (
                    batch_first and t.shape[0] == r0.rows):
                return None  # an unmapped operand with rows of its own: whose are they?
        return r0

    def _matmul(self, name, ins, mapped, outs) -> Optional[Rows]:
        a = ins[0]
        if len(outs) != 1:
            return None
        ra = next((r for t, r in mapped if t is a), None)
        if name == "embedding":  # F.embedding(indices, weight)
            return ra if ra is not None and outs[0].shape[0] == ra.rows else None
        if ra is None:
            return None  # a shared matrix times mapped rows: the rows are mixed
        if name in ("linear",) or all(t is a or t.dim() <= 2 for t in ins[1:]):
            return ra if a.dim() >= 2 and outs[0].shape[0] == ra.rows else None
        return self._same(ins, mapped, outs, ra)  # batched: every ≥3-D operand with the same map

    @staticmethod
    def _index_op(name, args, kwargs, ins, mapped, outs) -> Optional[Rows]:
        src = ins[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        idx = args[2] if len(args) > 2 else kwargs.get("index")
        rs = rows_of(src)
        if not isinstance(dim, int) or not isinstance(idx, torch.Tensor):
            return None
        if name == "index_select":
            if rs is None:
                return None
            if dim % src.dim() != 0:
                return rs if outs[0].shape[0] == rs.rows else None
            return Rows(rs.b, index=rs.examples(idx.device)[idx])
        # index_add / index_copy: rows of ``source`` written into rows idx of ``src``, which must be theirs
        source = args[3] if len(args) > 3 else kwargs.get("source")
        rsrc = rows_of(source)
        if rs is None or rsrc is None or dim % src.dim() != 0 or rs.b != rsrc.b:
            return None
        if not torch.equal(rs.examples(idx.device)[idx], rsrc.examples(idx.device)):
            return None
        return rs
