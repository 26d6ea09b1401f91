"""The layout check: before the first update, prove that every site's input is batch first and per example
(docs/design.md, *The per-example engine*).

The engine reads each layer's batch from the first dimension of its input. Two layouts pass every shape
check and still give wrong per-example gradients: a time-first activation ``(T, B, d)`` when T == B (the
engine would clip per time step), and an input shared by every example (T5's relative attention bias: an
embedding of ``(L, L)`` position buckets broadcast over the batch) when L == B. Batch statistics or attention
across examples mix examples the same way. None of these can be seen from shapes; all are seen by how a
site's input moves when the batch is re-indexed.

:func:`.mixing.run_layout_check` runs the user's forward twice without gradients, in training mode with
dropout switched off (``mixing.check_modes``) and from the same random state: on the micro-batch, and on a copy re-indexed by ``s``, a
fixed permutation of the B examples in which one example is repeated (``s[1] = s[0]``). For a per-example,
batch-first site the second input is exactly the first one's rows ``s``: ``x' = x[s]``. A time-first input
becomes ``x[:, s]``, a shared one stays ``x``, and one that mixes examples (a statistic over the batch, which
the repeated example changes) is neither. Each tensor argument of each call is compared in that way (an
argument whose first dimension is not B must not change at all). To keep memory at ``O(B)`` numbers per
argument, not a copy of every activation, each row is summarised by its norm and two random projections in
float64 (projections commute with row indexing), compared with a relative tolerance of 1e-3 (3e-2 for
16-bit inputs): far above the rounding between two batched forwards, far below any layout error.

A failure is refused before any update, one line per module class and cause, with the fix: batch-first
activations, freezing a shared parameter (named), or making each example's computation its own. What the
check cannot see, examples mixed after the last site (in the loss) or only at later micro-batches, is the
spot check's (``mixing.py``), which follows it in the same call.

Cost: two forwards without gradients at the first micro-batch of a fit (repeated at later micro-batches only
while some rank has not yet had two or more examples), and one all-reduce of two numbers per check.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from ..util.collectives import sum_over_ranks
from .base import UnsupportedLayerError
from .parameters import ParameterHook
from .provenance import by_example, lost_at, rows_of

#: random projections per row of each recorded tensor
PROJECTIONS = 2
#: relative tolerance on a row's projections and norm (inputs in float32/float64; 16-bit inputs: HALF_TOL)
TOL, HALF_TOL = 1e-3, 3e-2
#: module names shown per refusal line before "and N more"
SHOWN = 3


def batch_checked_input(hook, x: Any, extra: tuple[tuple, dict], expected: Optional[int]) -> Any:
    """One call's input, checked against the micro-batch before the call runs: its batch (the rule's
    :meth:`~.base.LayerRule.batch_size`) must be ``expected`` examples, in dimension 0 unless the rule says
    otherwise; a ``(1, ...)`` input of a ``broadcast_batch`` rule is expanded to the batch. ``expected``
    ``None``: not known (read from the input). Raises ``UnsupportedLayerError`` naming the layer and the fix
    (batch first; no flattening of the batch into the rows)."""
    found = hook.rule.batch_size(hook.module, x, extra)
    if found is None:
        raise UnsupportedLayerError(f"'{hook.name}' needs a tensor input with the batch dimension first.")
    n, dim = found
    if isinstance(x, torch.Tensor) and x.dim() < hook.rule.min_input_dim:
        # a (T,) index such as nanoGPT's pos_emb(torch.arange(T)) has no batch dimension; when T equals the
        # micro-batch size it would pass the check below and mix examples' gradients
        raise UnsupportedLayerError(
            f"{type(hook.module).__name__} '{hook.name}' received indices of shape {tuple(x.shape)}, with no "
            "batch dimension; per-example clipping needs (B, T) or (1, T) indices (a (1, T) input is used for "
            "every example): e.g. pos_emb(torch.arange(T, device=x.device)[None]), and (B, 1) for one index "
            "per example.")
    b = expected
    if b is not None and n == 1 and b != 1 and hook.rule.broadcast_batch:  # (dimension 0 rules only)
        x, n = x.expand(b, *x.shape[1:]), b
    if b is not None and n != b:
        where = (f"whose first dimension is {n}" if dim == 0 else f"whose batch dimension ({dim}) is {n}"
                 if dim is not None else f"of {n} examples (the micro-batch size is read from the batch's "
                 "first tensor: put one with a row per example, e.g. the labels, before flat indices)")
        raise UnsupportedLayerError(
            f"{type(hook.module).__name__} '{hook.name}' received an input {where}, but the "
            f"micro-batch has {b} examples. Per-example clipping needs the batch dimension first in every "
            "layer: keep inputs as (B, T, d) instead of flattening to (B*T, d), and use batch_first=True; and "
            "the training forward must run on the micro-batch drawn for the step, not on other data."
        )
    return x


def index_map(b: int) -> torch.Tensor:
    """The re-indexing ``s`` of a micro-batch of ``b`` examples: a fixed permutation with ``s[1] = s[0]``."""
    s = torch.randperm(b, generator=torch.Generator().manual_seed(0))
    if b >= 2:
        s[1] = s[0]
    return s


def reindex_batch(batch: Any, index: Optional[torch.Tensor], batch_size: Optional[int] = None) -> Any:
    """``batch`` with every tensor whose first dimension is ``batch_size`` (default ``len(index)``: a
    re-ordering; fewer: a sub-batch) indexed by ``index`` (rows ``index[i]`` become row i); mappings, sequences
    and dataclasses are walked (Lightning's ``apply_to_collection``); ``index=None`` returns ``batch`` itself."""
    if index is None:
        return batch
    from lightning_utilities.core.apply_func import apply_to_collection

    b = len(index) if batch_size is None else int(batch_size)
    return apply_to_collection(batch, torch.Tensor,
                               lambda t: t[index.to(t.device)] if t.dim() >= 1 and t.shape[0] == b else t)


class _Rows:
    """A tensor summarised per row (along dimension ``dim``): exact values for integers, else norms and random
    projections in float64."""

    __slots__ = ("shape", "dim", "exact", "norms", "proj", "tol", "lengths", "special")

    def __init__(self, t: torch.Tensor, dim: int, vectors: "_Vectors"):
        self.shape, self.dim, self.lengths, self.special = tuple(t.shape), dim, None, None
        t = t.detach().movedim(dim, 0)
        self.exact = None if t.is_floating_point() else t.clone()
        self.tol = TOL if t.dtype in (torch.float32, torch.float64) else HALF_TOL
        if self.exact is None:
            t, self.special = _split_special(t)
            rows = t.reshape(t.shape[0], math.prod(t.shape[1:]))  # explicit: B may be 0
            v = vectors.get(rows.shape[1], rows.device)
            step = max(1, 2 ** 22 // max(rows.shape[1], 1))
            parts = [rows[i:i + step].double() for i in range(0, rows.shape[0], step)]
            self.norms = torch.cat([p.norm(dim=1) for p in parts]) if parts else torch.zeros(0, dtype=torch.float64)
            self.proj = torch.cat([p @ v for p in parts]) if parts else torch.zeros(0, PROJECTIONS, dtype=torch.float64)

    @classmethod
    def ragged(cls, rows: list, vectors: "_Vectors") -> "_Rows":
        """Rows of unequal lengths (a ragged input: example i's sequence or bag), each summarised alone."""
        self = cls.__new__(cls)
        flat = [r.detach().reshape(-1) for r in rows]
        self.special = None
        self.shape, self.dim, self.lengths = (len(flat), "ragged"), 0, torch.tensor([r.numel() for r in flat])
        floating = bool(flat) and flat[0].is_floating_point()
        self.exact = None if floating or not flat else [r.clone() for r in flat]
        self.tol = TOL if not flat or flat[0].dtype in (torch.float32, torch.float64) else HALF_TOL
        if not flat:
            self.exact = []
        elif floating:
            self.norms = torch.stack([r.double().norm() for r in flat])
            self.proj = torch.stack([r.double() @ vectors.get(r.numel(), r.device) for r in flat])
        return self

    def matches(self, other: "_Rows", index: Optional[torch.Tensor] = None) -> bool:
        """Whether ``other`` holds this tensor's rows ``index`` (``None``: the same rows)."""
        want = self.shape if index is None else (  # a sub-batch: its rows only
            *self.shape[:self.dim], len(index), *self.shape[self.dim + 1:])
        if other is None or other.shape != want:
            return False
        if self.lengths is not None:
            mine = self.lengths if index is None else self.lengths[index]
            if not torch.equal(mine, other.lengths):
                return False
        if isinstance(self.exact, list):
            order = range(len(self.exact)) if index is None else index.tolist()
            return isinstance(other.exact, list) and all(torch.equal(self.exact[i], o)
                                                         for i, o in zip(order, other.exact))
        if self.exact is not None:
            mine = self.exact if index is None else self.exact[index.to(self.exact.device)]
            return other.exact is not None and torch.equal(mine, other.exact)
        if other.exact is not None:
            return False
        if not _same_special(self.special if self.special is None or index is None
                             else self.special[index.to(self.special.device)], other.special):
            return False
        norms, proj = (self.norms, self.proj) if index is None else (self.norms[index], self.proj[index])
        if not norms.numel():
            return True
        # a row's deviation δ moves each projection by about ‖δ‖ (vectors of N(0, 1) entries): 3 σ of margin
        tol = max(self.tol, other.tol) * (norms + 1e-6 * float(norms.max()) + 1e-30)
        return bool(((other.proj - proj).abs() <= 3 * tol.unsqueeze(1)).all()
                    and ((other.norms - norms).abs() <= tol).all())


def _split_special(t: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A float tensor's finite part (non-finite entries zeroed) and, if it has any, the exact per-row pattern of
    its ±inf and NaN entries (a float attention mask's ``-inf``: norms and projections of such rows are inf or NaN,
    and no two compare equal)."""
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return t, None
    code = torch.where(torch.isnan(t), 3, torch.where(t > 0, 1, 2)).to(torch.int8) * (~finite).to(torch.int8)
    return torch.where(finite, t, torch.zeros((), dtype=t.dtype, device=t.device)), code.reshape(t.shape[0], -1)


def _same_special(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Whether two rows' patterns of non-finite entries agree (``None``: all finite; a sub-batch may hold only
    the rows that have none)."""
    if a is None or b is None:
        return (a is None or not bool(a.any())) and (b is None or not bool(b.any()))
    return torch.equal(a, b)


class _Vectors:
    """One fixed set of random projection vectors per row length and device (the same in both forwards)."""

    def __init__(self):
        self.cache: dict = {}

    def get(self, m: int, device) -> torch.Tensor:
        key = (m, str(device))
        if key not in self.cache:
            gen = torch.Generator().manual_seed(m)
            self.cache[key] = torch.randn(m, PROJECTIONS, generator=gen, dtype=torch.float64).to(device)
        return self.cache[key]


class _Recorder:
    """What each call of an attached layer received, in call order (``PerSampleEngine._record_call``)."""

    def __init__(self, b: int, vectors: _Vectors):
        self.b, self.vectors, self.calls, self.loss = b, vectors, [], None
        self.rows, self.lost = b, {}  # the examples this pass runs; per layer, the op that lost its rows' map

    def record(self, hook, args: tuple, kwargs: dict) -> None:
        rows = []
        for t in hook.rule.layout_inputs(hook.module, args, kwargs):
            if lost_at(t) is not None and t.shape[0] != self.rows:  # token-major rows whose examples were lost
                self.lost.setdefault(hook, lost_at(t))
            mapped = rows_of(t)
            if mapped is not None and not (mapped.blocks and mapped.m == 1):  # token-major: per example
                t = by_example(t, mapped)
                hook.engine.tracking.seen = True
            if isinstance(t, list):  # a ragged input: one tensor per example
                rows.append((_Rows.ragged(t, self.vectors), None))
                continue
            if type(t) is not torch.Tensor and isinstance(t, torch.Tensor):
                # (a shared value reaching a layer unbroadcast, broadcast.py: its summary is a plain tensor's)
                with torch._C.DisableTorchFunctionSubclass():
                    t = t.as_subclass(torch.Tensor)
            by_batch = _Rows(t, 0, self.vectors)
            time_first = _Rows(t, 1, self.vectors) if t.dim() >= 2 and t.shape[1] == self.b else None
            rows.append((by_batch, time_first))
        self.calls.append((hook, rows))


def _record(engine, run_forward, index, b: int, vectors: _Vectors) -> _Recorder:
    """One forward of the check on the micro-batch re-indexed by ``index``, from the same random state as the
    others (forked: the user's stream does not advance); its calls recorded, its loss kept (``rec.loss``)."""
    rec = _Recorder(b, vectors)
    rec.index = index  # this pass's re-indexing (broadcast.py tags shared values' copies by example)
    rec.rows = b if index is None else len(index)  # the examples this pass runs (fewer in the spot check's)
    engine._layout = rec
    try:
        with torch.random.fork_rng(devices=_devices()), torch.no_grad():
            rec.loss = loss_value(run_forward(index))
    finally:
        engine._layout = None
    return rec


def loss_value(out: Any) -> Optional[tuple[float, bool]]:
    """The scalar loss of a forward's output (a tensor, a mapping or Hugging Face output with ``"loss"``) in
    float64 and whether it was computed in 16 bits; ``None`` if there is none."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        return None
    return float(loss.detach().double()), loss.dtype not in (torch.float32, torch.float64)


def _devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def _classify(hook, k: int, ref: tuple, new: tuple, s: torch.Tensor, b: int) -> Optional[str]:
    """``None`` if tensor argument ``k`` of a call moved as a batch-first, per-example input does; else the
    cause. The first tensor of a layer's call (not of a module with per-example views, whose own check covers
    it) must have the batch first; another argument may instead be the same for every example (a mask)."""
    (r0, r1), (n0, n1) = ref, new
    broadcast = r0.shape[0] == 1 and b != 1 and hook.rule.broadcast_batch  # (1, T) positions: one copy each
    must_batch = k == 0 and not isinstance(hook, ParameterHook) and not broadcast
    if r0.shape[0] == b and not broadcast:
        if b < 2 or r0.matches(n0, s):
            return None
    elif not must_batch and r0.matches(n0):
        return None
    if r0.matches(n0):
        return "shared"
    if r1 is not None and r1.matches(n1, s):
        return "time-first"
    return "mixed" if r0.shape[0] == b else "not batch first"


def _failures(ref: _Recorder, new: _Recorder, s: torch.Tensor, b: int) -> list[tuple[Any, str]]:
    if [h for h, _ in ref.calls] != [h for h, _ in new.calls] or any(
            len(a) != len(c) for (_, a), (_, c) in zip(ref.calls, new.calls)):
        first = next(((h, "calls") for (h, a), (g, c) in zip(ref.calls, new.calls) if h is not g or len(a) != len(c)),
                     (ref.calls[-1][0] if ref.calls else None, "calls"))
        return [first] if first[0] is not None else []
    out = []
    for (hook, rows), (_, new_rows) in zip(ref.calls, new.calls):
        for k, (r, n) in enumerate(zip(rows, new_rows)):
            cause = _classify(hook, k, r, n, s, b)
            if cause == "not batch first" and hook in ref.lost:
                cause = f"lost {ref.lost[hook]}"
            if cause is not None:
                out.append((hook, cause))
                break
    return out


_WHY = {
    "time-first": ("its input has the batch in its second dimension (time-first (T, B, ...), which passes the "
                   "engine's check when T equals B), so the engine would clip per position instead of per example. "
                   "Fix: keep the activations batch first, (B, T, ...), through every layer with parameters "
                   "(transpose back before such a layer, batch_first=True)"),
    "shared": ("its input is the same whatever the examples of the batch (shared by every example and broadcast "
               "over the batch, e.g. T5's relative position buckets (L, L)), so its output has no per-example part "
               "and its parameters cannot be clipped per example"),
    "mixed": ("row i of its input depends on other examples than i (statistics over the batch such as "
              "h - h.mean(0), mixup, attention across the examples, or randomness drawn in training_step or the "
              "forward, such as F.dropout: use nn.Dropout modules, which the check switches off), so per-example "
              "gradients do not exist. Fix: make each example's computation depend on that example only"),
    "not batch first": ("its input's first dimension is not the micro-batch, and the input changes with the "
                        "examples. Fix: keep every layer's input batch first, (B, ...)"),
    "calls": ("the forward calls its layers in another order, or with other arguments, when the examples are "
              "re-ordered (control flow that depends on the batch), so per-example gradients cannot be checked. "
              "Fix: make the forward's control flow the same for every order of the examples"),
}


def layer_lines(engine, failures: list[tuple[Any, str]]) -> list[str]:
    """One line per module class and cause of ``failures`` (``(hook, cause)`` pairs), with the fix."""
    groups: dict[tuple[str, str], list] = {}
    for hook, cause in failures:
        groups.setdefault((type(hook.module).__name__, cause), [])
        if hook not in groups[(type(hook.module).__name__, cause)]:
            groups[(type(hook.module).__name__, cause)].append(hook)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    lines = []
    for (cls, cause), hooks in groups.items():
        shown = ", ".join(f"'{h.name}'" for h in hooks[:SHOWN])
        more = f" and {len(hooks) - SHOWN} more" if len(hooks) > SHOWN else ""
        why = _WHY[cause] if not cause.startswith("lost ") else (
            f"its input's rows are the examples' tokens, computed from the micro-batch through '{cause[5:]}', an "
            "operation after which the engine cannot tell each row's example (docs/design.md, Token-major "
            "layers). Fix: keep its input batch first, (B, ...), or form its rows with reshapes, indexing along "
            "the rows and operations that keep the rows")
        if cause == "shared":
            params = [names[id(p)] for h in hooks for p in h.rule.params(h.module)
                      if p is not None and p.requires_grad and id(p) in names]
            fix = (f"module.get_parameter({params[0]!r}).requires_grad_(False)" if len(params) == 1 else
                   f"for name in {params}: module.get_parameter(name).requires_grad_(False)")
            why += (f". Fix: freeze {'it' if len(params) == 1 else 'them'} before training: {fix} (module: the "
                    "model given to the engine; with Lightning, the LightningModule)")
        lines.append(f"{cls} {shown}{more}: {why}")
    return lines


def agree_or_raise(engine, lines: list[str], b: int, pending: bool, collectives, what: str,
                   again: bool = False) -> tuple[bool, bool]:
    """Agree over the ranks (one all-reduce of three numbers) on whether any rank has failure ``lines``, and
    raise on every rank if one has; ``what``: which micro-batch was checked. Returns whether no rank is
    ``pending`` (checked with fewer than two examples), and whether any rank asks to check ``again`` (an
    embedding on shared indices marked as such: every rank then runs the same forwards again)."""
    bad, pending_n, again_n = float(bool(lines)), float(pending), float(again)
    world = getattr(collectives, "world_size", 1) if collectives is not None else 1
    rank = getattr(collectives, "global_rank", 0) if world > 1 else 0
    bad_all, rank0_bad = bad, bad
    if world > 1:
        flags = sum_over_ranks(collectives, torch.tensor([bad, pending_n, again_n, bad if rank == 0 else 0.0],
                                                         dtype=torch.float32, device=_reduce_device(engine)))
        bad_all, pending_n, again_n, rank0_bad = (float(f) for f in flags)
    if lines:
        error = UnsupportedLayerError(
            f"The per-example layout check failed at {what} (with the micro-batch of {b} examples re-indexed, or "
            "some of its examples run alone, a layer's input or the loss did not follow its examples); training would "
            "release non-private updates, so it stops before this micro-batch's update:\n  - "
            + "\n  - ".join(lines)
            + "\nThe check can be turned off only explicitly (DPDeepSpeedStrategy(layout_check=\"off\")).")
        # a failure rank 0 does not share is printed by the rank that found it (rank 0 only says where it is)
        error.print_on_this_rank = rank != 0 and not rank0_bad
        raise error
    if bad_all:
        raise UnsupportedLayerError(f"The per-example layout check failed on {int(bad_all)} other rank(s), at {what} "
                                    "(their error names the layers); training stops before this micro-batch's update.")
    return pending_n == 0, again_n > 0


def _reduce_device(engine) -> torch.device:
    p = next(engine.module.parameters(), None)
    return p.device if p is not None and p.device.type != "meta" else torch.device("cpu")

