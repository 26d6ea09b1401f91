"""The arithmetic the rules share: rows of a matrix product per example, per-example norms, weighted sums.

A layer that is a matrix product over T rows per example (Linear, convolution as unfolded patches, HF
Conv1D, attention projections) has, for one example with input rows ``a_t ∈ R^d`` and output gradients
``g_t ∈ R^p``, the weight gradient ``G = Σ_t g_t a_tᵀ`` (p×d). Which formula forms its norm (ghost or
instantiated) is decided in :mod:`.paths`; the functions here only compute. Shapes are batch first; norms
and per-example tensors are fp32, clipped sums are in the output gradient's dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def batch_rows(t: torch.Tensor) -> torch.Tensor:
    """``(B, ...)`` → ``(B, T, d)`` where T folds every middle dimension (a sequence of T tokens)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])  # explicit: B may be 0


def param_shape(p: torch.Tensor) -> torch.Size:
    """The full shape of a parameter, also while ZeRO-3 has released its data (``ds_shape``)."""
    return getattr(p, "ds_shape", p.shape)


def rows_per_example(a: torch.Tensor, g: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-example ``G_i = Σ_t g_{i,t} a_{i,t}ᵀ`` for ``a`` (B,T,d), ``g`` (B,T,p): fp32 ``(B, p, d)``, one bmm.

    Where d < p the bmm forms ``(B, d, p)`` and the result is its transposed view: MKL's bmm was measured 1.2-5×
    slower with the thinner dimension last (a LoRA up-projection's ``(B, 256, 8)``: 327 µs against 91 µs).
    :func:`per_example_sq` and :func:`weighted_sum` read either layout without a copy. ``out``: B·p·d fp32 values
    per example (a block of :func:`joint_rows`) that the bmm writes into."""
    a, g = a.float(), g.float()
    B, d, p = a.shape[0], a.shape[-1], g.shape[-1]
    if d < p:
        return torch.bmm(a.transpose(1, 2), g, out=None if out is None else out.view(B, d, p)).transpose(1, 2)
    return torch.bmm(g.transpose(1, 2), a, out=None if out is None else out.view(B, p, d))


def joint_rows(B: int, sizes: list[int], like: torch.Tensor) -> list[torch.Tensor]:
    """Column blocks ``(B, n_k)`` of one fp32 ``(B, Σ n_k)`` buffer on ``like``'s device: a site's per-example
    gradients written side by side there take one squared-norm op and one weighted sum for all its parameters
    (:func:`joined`, :func:`weighted_sum`), not one of each per parameter."""
    return list(torch.empty(B, sum(sizes), dtype=torch.float32, device=like.device).split(sizes, 1))


def joined(blocks: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The ``(B, Σ n_k)`` buffer whose consecutive column blocks are exactly ``blocks`` (:func:`joint_rows`), else
    ``None``."""
    base = blocks[0]._base
    if base is None or base.dim() != 2 or any(t._base is not base for t in blocks):
        return None
    offset = base.storage_offset()
    for t in blocks:
        if t.storage_offset() != offset:
            return None
        offset += math.prod(t.shape[1:])
    return base if offset == base.storage_offset() + base.shape[1] else None


def split_sum(total: torch.Tensor, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """A weighted sum ``(Σ n_k,)`` of a :func:`joined` buffer as one view per block, each of its block's shape less
    the batch dimension (a block of :func:`rows_per_example`'s transposed layout: the transposed view)."""
    out = []
    for t, part in zip(blocks, total.split([math.prod(b.shape[1:]) for b in blocks])):
        if t.dim() == 3 and t.stride(-1) != 1:
            out.append(part.view(t.shape[2], t.shape[1]).t())
        else:
            out.append(part.view(t.shape[1:]))
    return out


def rows_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w`` for rows ``a`` (..., k) and a matrix ``w`` (k, n): a layer's input gradient ``g @ W``.

    On the CPU, where ``w`` is contiguous and its result narrow (2 ≤ n ≤ 8 columns from k ≥ 64), MKL's
    product of that layout was measured 3-5× slower than the same product transposed, ``(wᵀ aᵀ)ᵀ``: a LoRA
    up-projection's input gradient, (1024, 256) @ (256, 8), took 300 µs against 90 µs (one copy included).
    That case is formed transposed; every other is ``a.matmul(w)``. Same result up to rounding."""
    k, n = w.shape
    if (a.device.type != "cpu" or not 2 <= n <= 8 or k < 64 or not w.is_contiguous() or a.dim() < 2
            or a.dtype not in (torch.float32, torch.float64) or a.numel() == 0):
        return a.matmul(w)
    a2 = a.reshape(-1, k)
    return torch.mm(w.t(), a2.t()).t().contiguous().view(*a.shape[:-1], n)


def rows_norm_sq(a: torch.Tensor, g: torch.Tensor, path: str, grams: Optional["InputGrams"] = None,
                 plus: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-example ‖Σ_t g_t a_tᵀ‖² for ``a`` (B,T,d), ``g`` (B,T,p), returned fp32 ``(B,)``.

    ``path`` (from :func:`.paths.choose_path`): ``"ghost"`` uses ``Σ_{t,s} (a_t·a_s)(g_t·g_s)`` (Li et al.
    2021), anything else instantiates the ``(B, p, d)`` gradients. With one row (T = 1) the norm is the
    product of the two row norms whatever the path. ``grams``: where given, the ghost norm takes ``a aᵀ`` from
    it, shared with the layers before it that read the same input rows. ``plus`` (B,): added to the result
    (in the same op where the path allows: a site's bias norms)."""
    if a.shape[1] == 1:
        out = a.float().pow(2).sum((1, 2)) * g.float().pow(2).sum((1, 2))
        return out if plus is None else out + plus
    if path == "ghost":
        gf = g.float()
        aa = grams.of(a) if grams is not None else _gram(a)
        return rows_dot(aa, torch.bmm(gf, gf.transpose(1, 2)), plus)  # Σ_{t,s}: one batched dot, not mul + sum
    return per_example_sq(rows_per_example(a.float(), g.float()), plus)


def rows_dot(u: torch.Tensor, v: torch.Tensor, plus: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Σ_j u_ij v_ij`` per example of ``u``, ``v`` (B, ...) fp32, as ``(B,)``: one ``bmm`` (``plus`` (B,) added in
    the same op, ``baddbmm``)."""
    B = u.shape[0]
    a, b = u.reshape(B, 1, math.prod(u.shape[1:])), v.reshape(B, math.prod(v.shape[1:]), 1)
    out = torch.bmm(a, b) if plus is None else torch.baddbmm(plus.view(-1, 1, 1), a, b)
    return out.view(B)


def _gram(a: torch.Tensor) -> torch.Tensor:
    af = a.float()
    return torch.bmm(af, af.transpose(1, 2))


class InputGrams:
    """The Gram matrices ``a aᵀ`` (B, T, T) fp32 of the last input rows a ghost norm read, for the layers that
    read the same input: a decoder block's q, k and v projections, a gated MLP's gate and up projections, the
    three projections of a self-attention. Each such layer then forms only its output gradients' Gram (Li et
    al. 2021's ghost norm costs ``T²(d + p)`` per example; the ``T²d`` half is formed once per input).

    One entry: the layers that read one input run their backward one after another. It is keyed by the rows'
    memory, shape, strides, dtype and version counter, and holds the rows, so that their memory cannot be
    reused by another tensor while the entry lives. The engine owns one and clears it when a backward pass
    ends; at most one extra ``(B, T, T)`` tensor lives between sites.

    Example:
        >>> grams = InputGrams()
        >>> a = torch.randn(2, 3, 4)
        >>> grams.of(a) is grams.of(a.view(2, 3, 4))  # the same rows: formed once
        True
        >>> torch.allclose(grams.of(a), a @ a.transpose(1, 2))
        True
    """

    __slots__ = ("_key", "_rows", "_gram")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the entry (end of a backward pass)."""
        self._key: Optional[tuple] = None
        self._rows: Optional[torch.Tensor] = None
        self._gram: Optional[torch.Tensor] = None

    def of(self, a: torch.Tensor) -> torch.Tensor:
        """``a aᵀ`` in fp32 for rows ``a`` (B, T, d): the entry's when ``a`` views the same rows, else formed
        (and kept in place of the entry)."""
        key = (a.device, a.data_ptr(), a.dtype, tuple(a.shape), a.stride(), a._version)
        if self._rows is None or key != self._key:
            self._key, self._rows, self._gram = key, a, _gram(a)
        return self._gram


#: per-example sizes up to which a squared norm is a batched dot (one ``bmm``/``baddbmm``, the other squared norms
#: of the site added in it) rather than a norm kernel, a square and an add: small layers, whose steps are bound by
#: the kernels launched, not by their arithmetic; larger ones keep the reduction kernel built for long rows
DOT_MAX = 1 << 16


def per_example_sq(t: torch.Tensor, plus: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Squared norm of each example's slice of ``t`` (B, ...), fp32 ``(B,)``, without a squared copy of ``t`` (nor
    a contiguous one); with ``plus`` (B,) fp32, ``plus`` + that in the same op (a site's other squared norms)."""
    t = t.float()
    if t.dim() <= 1:
        return t.pow(2) if plus is None else torch.addcmul(plus, t, t)
    if t.dim() == 3 and not t.is_contiguous() and t.transpose(1, 2).is_contiguous():
        t = t.transpose(1, 2)  # rows_per_example's transposed view: the same values, contiguous
    if t.is_contiguous() and math.prod(t.shape[1:]) <= DOT_MAX:
        return rows_dot(t, t, plus)  # one kernel, the add included
    n = torch.linalg.vector_norm(t, dim=tuple(range(1, t.dim())))
    return n.pow(2) if plus is None else torch.addcmul(plus, n, n)


def rows_sq(t: torch.Tensor, plus: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Σ_j t_ij²`` of each row of a small ``t`` (B, n) (a bias's or a norm layer's per-example gradients), fp32
    ``(B,)``: one batched dot product (``bmm``), and with ``plus`` (B,) fp32 ``plus`` + that in the same op
    (``baddbmm``), where squares, a sum and an add would take three kernels."""
    t = t.float()
    return rows_dot(t, t, plus)


def weighted_rows_grad(a: torch.Tensor, g: torch.Tensor, coef: torch.Tensor,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Σ_i coef_i Σ_t g_{i,t} a_{i,t}ᵀ`` as a (p, d) matrix in ``g``'s dtype: one matmul, no B×p×d tensor.
    The coefficients scale the smaller of the two factors (``a`` when d < p), one pass over B·T·min(d, p).
    ``out`` (p, d) in ``g``'s dtype: the sum is added into it in place (one ``addmm_``, no temporary)."""
    c = coef.to(g.dtype).view(-1, 1, 1)
    a = a.to(g.dtype)
    if a.shape[-1] < g.shape[-1]:
        a = a * c
    else:
        g = g * c
    g2, a2 = g.reshape(-1, g.shape[-1]).t(), a.reshape(-1, a.shape[-1])
    return g2.mm(a2) if out is None else out.addmm_(g2, a2)


def weighted_sum(per: torch.Tensor, coef: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``alpha · Σ_i coef_i · per_i`` for ``per`` (B, ...) fp32: one ``(B,)·(B, n)`` product (``alpha`` in it),
    shape ``per.shape[1:]``; for the transposed ``(B, p, d)`` view of :func:`rows_per_example`, the transposed sum
    of its contiguous form."""
    if per.dim() == 3 and not per.is_contiguous() and per.transpose(1, 2).is_contiguous():
        return weighted_sum(per.transpose(1, 2), coef, alpha).t()
    # (B, n) explicitly, not flatten(1): a scalar parameter's per-example gradients are (B,), and B may be 0
    rows, c = per.reshape(per.shape[0], math.prod(per.shape[1:])), coef.to(per.dtype).view(1, -1)
    if alpha == 1.0 or rows.shape[0] == 0:
        return c.mm(rows).view(per.shape[1:])
    # beta=0: the input (any row of the right shape) is not read, NaN or not
    return torch.addmm(rows[:1], c, rows, beta=0, alpha=alpha).view(per.shape[1:])


def add_weighted_rows(into: Optional[torch.Tensor], per: torch.Tensor, coef: torch.Tensor) -> bool:
    """Add ``Σ_i coef_i · per_i`` of small per-example rows ``per`` (B, n) into ``into`` (a parameter's gradient of
    n values, same dtype, contiguous) in place: one ``addmm_`` where a sum and then an add would take two.
    ``False`` (nothing done) where ``into`` is ``None`` or of another dtype."""
    if into is None or into.dtype != per.dtype or not per.is_contiguous():
        return False
    into.view(1, -1).addmm_(coef.to(per.dtype).view(1, -1), per.reshape(per.shape[0], -1))
    return True


def weighted_sum_parts(parts: list[torch.Tensor], coef: torch.Tensor) -> torch.Tensor:
    """:func:`weighted_sum` of per-example tensors held as parts along the batch (in order; ``coef`` (B,) for
    all of them), without joining them: one ``(b,)·(b, n)`` product per part, summed."""
    out = None
    for part, c in zip(parts, coef.split([part.shape[0] for part in parts])):
        s = weighted_sum(part, c)
        out = s if out is None else out.add_(s)
    return out
