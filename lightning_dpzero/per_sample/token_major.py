"""Token-major sites: a layer whose input rows are the examples' tokens, ``(B·m, ...)`` (docs/design.md,
*Token-major layers*; the row maps: ``provenance.py``).

The engine enters :class:`~.provenance.RowTracker` around each forward it clips or the layout check records
(forward pre- and post-hooks on every module with children, entered once by the outermost). At a layer call
whose input's first dimension is not the micro-batch:

* the input has a map of contiguous equal blocks (a reshape of ``(B, m, ...)``) and the layer's rule computes
  each row from that row alone (:attr:`~.base.LayerRule.rows_independent`: Linear, LayerNorm, RMSNorm,
  Embedding): the input is viewed as ``(B, m, ...)``, the rule runs unchanged on it (example i's gradient is the
  sum over its m rows, as for a sequence), and the output is viewed back to ``(B·m, ...)``;
* the input's rows are gathered from the examples by an index (an MoE's dispatch: ``hidden[token_idx]`` with
  ``token_idx`` from ``torch.where``, ``index_select`` or a boolean mask; any number of rows per example, none
  included) and the rule is row-wise: the rows are laid out per example (:class:`Gathered`), row r in slot
  ``slot[r]`` of its example ``e[r]`` of a zero-filled ``(B, n_max, ...)`` input, n_max the most rows of one
  example; the rule runs unchanged on it and the output's rows are read back from the same slots. A slot that
  holds no row gets a zero output gradient, so it adds nothing to any example's gradient: example i's gradient
  is the sum over its segment S_i of rows, its ghost norm ``Σ_{r,s ∈ S_i} (a_r·a_s)(g_r·g_s)`` (Li et al. 2021)
  or its instantiated ``Σ_{r ∈ S_i} g_r a_rᵀ`` (the rule's choice, as for a sequence of n_max tokens), and the
  clipped sum weights row r by c_{e[r]} (the rule's ``Σ_i c_i Σ_t g_it a_itᵀ`` over the slots). The cost is
  the rule's on B·n_max rows instead of the R gathered ones (n_max ≤ the tokens of an example for an expert,
  whatever the routing);
* a generic-rule module (an MoE router, HF's grouped experts) gets its per-example gradients from one
  recomputation per example on that example's rows (``generic.py``);
* anything else (a rule that is not row-wise, a lost map) is refused before the first update, naming the layer
  and the reason.

The layout check records a mapped input per example (``provenance.by_example``): with the batch re-indexed,
example i's rows must be example s[i]'s, and alone, its rows in the full micro-batch: the map is proven as a
batch-first layout is.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

from .base import LayerRule, UnsupportedLayerError
from .provenance import Rows, RowTracker, lost_at, mark, rows_of, seed
from .units import slots


class Tracking:
    """The row tracker of one engine and the hooks that enter it around forwards (``install``)."""

    def __init__(self, engine):
        self.engine, self.mode, self.handles, self.entered = engine, RowTracker(), [], []
        self.checkpointed: list = []  # (layer, its own checkpoint function) wrapped by _track_recomputation
        self.seen = False  # a token-major site was met (the layout check keeps tracking on only then)
        self.needed: Optional[bool] = None  # None: not yet known (track); False: the check found no such site
        self.gathered: Optional[tuple] = None  # the last gathered input laid out: (x, version, Gathered, padded)

    def install(self, module: torch.nn.Module) -> "Tracking":
        for m in module.modules():
            if next(m.children(), None) is not None or m is module:
                self.handles.append(m.register_forward_pre_hook(self._enter))
                self.handles.append(m.register_forward_hook(self._exit, always_call=True))
            if callable(m.__dict__.get("_gradient_checkpointing_func")):
                self._track_recomputation(m)
        return self

    def _track_recomputation(self, layer: torch.nn.Module) -> None:
        """Hugging Face's activation checkpointing recomputes a layer's ``forward`` in the backward, not its
        ``__call__``: the hooks above do not run there, and a reshape in that forward (OPT's decoder layer:
        ``hidden_states.reshape(-1, d)``) would lose its rows' examples. The layer's checkpoint function (an
        instance attribute, ``gradient_checkpointing_enable``) is wrapped so that the function it runs, the forward
        and its recomputation, enters the tracker as a hook would; ``remove`` restores it."""
        checkpoint = layer.__dict__["_gradient_checkpointing_func"]

        def tracked_checkpoint(fn, *args, **kwargs):
            def run(*a, **k):
                self._enter(layer, a)
                try:
                    return fn(*a, **k)
                finally:
                    self._exit(layer, a, None)
            return checkpoint(run, *args, **kwargs)
        layer._gradient_checkpointing_func = tracked_checkpoint
        self.checkpointed.append((layer, checkpoint))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        for layer, checkpoint in self.checkpointed:
            layer._gradient_checkpointing_func = checkpoint
        self.checkpointed = []
        while self.entered:
            self._exit(None, None, None)

    def examples(self) -> Optional[int]:
        """The examples of the forward now running (the micro-batch, or the layout check's sub-batch)."""
        eng = self.engine
        rec = eng._layout
        return getattr(rec, "rows", None) if rec is not None else eng.expected_batch_size

    def _active(self) -> bool:
        eng = self.engine
        return self.needed is not False and (eng._layout is not None or eng.clipping_now())

    def _enter(self, module, args) -> None:
        on = not self.entered and self._active()
        if on:
            self.mode.__enter__()
        self.entered.append(on)
        if on:
            for t in tree_flatten(args)[0]:
                seed(t, self.examples())

    def _exit(self, module, args, out) -> None:
        if self.entered and self.entered.pop():
            self.mode.__exit__(None, None, None)
            self.gathered = None  # a forward's rows are not kept past it


class Gathered:
    """Rows gathered from the examples by an index, laid out per example for a row-wise rule (module docstring).

    Args:
        rows: the rows' map (:class:`~.provenance.Rows` with an index: row r belongs to example ``e[r]``).
        device: where the slots are formed (the input's).

    Attributes: ``rows``; ``examples`` and ``slot`` ``(R,)`` int64, each row's example and its place among that
    example's rows (row order); ``n_max``, the most rows of one example (at least 1, so that a call on no row still
    runs the layer: on ZeRO-3 every rank then gathers the same layers).

    Example:
        >>> g = Gathered(Rows(3, index=torch.tensor([2, 0, 2])), "cpu")
        >>> g.pad(torch.tensor([[1.0], [2.0], [3.0]])).squeeze(-1).tolist()  # example 1: no row
        [[2.0, 0.0], [0.0, 0.0], [1.0, 3.0]]
        >>> g.unpad(g.pad(torch.tensor([[1.0], [2.0], [3.0]]))).squeeze(-1).tolist()
        [1.0, 2.0, 3.0]
    """

    __slots__ = ("rows", "examples", "slot", "n_max")

    def __init__(self, rows: Rows, device):
        self.rows = rows
        self.examples = rows.examples(device).to(device)
        counts = torch.bincount(self.examples, minlength=rows.b)
        self.n_max = max(1, int(counts.max()) if self.examples.numel() else 0)
        self.slot = slots(self.examples, counts)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``(R, ...)`` → ``(B, n_max, ...)``, row r at ``[e[r], slot[r]]``, zeros elsewhere (differentiable)."""
        return x.new_zeros(self.rows.b, self.n_max, *x.shape[1:]).index_put((self.examples, self.slot), x)

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """``(B, n_max, ...)`` → the ``(R, ...)`` rows at the slots (differentiable: the other slots' output
        gradients are zero)."""
        return out[self.examples, self.slot]


def refusal(hook, x: torch.Tensor, why: str) -> UnsupportedLayerError:
    return UnsupportedLayerError(
        f"{type(hook.module).__name__} '{hook.name}' received rows of shape {tuple(x.shape)} ({why}). Per-example "
        "clipping of a layer that gets the examples' tokens as rows needs each row's example: "
        "the engine follows it through reshapes, indexing along the rows and operations that keep the rows "
        "(docs/design.md, Token-major layers). Fix: keep this layer's input batch first, (B, ...), or compute "
        "it from the batch with those operations only.")


def _token_rows(x: Any) -> bool:
    """``x`` has a row map other than the batch's own: its rows are the examples' tokens even where their number
    equals the micro-batch's by chance (an expert given B of the B·T tokens, which its shape would take for the
    batch)."""
    rows = rows_of(x)
    return rows is not None and not (rows.blocks and rows.m == 1)


def _own_layout(hook, x: torch.Tensor, extra: tuple[tuple, dict], b: int) -> bool:
    """The rule reads the batch from elsewhere than the first dimension and finds the micro-batch's examples there
    (an RNN with ``batch_first=False``, an ``EmbeddingBag`` given offsets): no token rows."""
    if type(hook.rule).batch_size is LayerRule.batch_size:
        return False
    try:
        found = hook.rule.batch_size(hook.module, x, extra)
    except Exception:  # the layout check names what is wrong with such an input
        return False
    return found is not None and found[0] == b


def site_input(engine, hook, x: Any, extra: tuple[tuple, dict]) -> tuple[Any, Any]:
    """A clipped call's input: ``(x, None)`` as it is, or, for a token-major input of a row-wise rule, ``x``
    viewed as ``(B, m, ...)`` and its map, or gathered rows laid out ``(B, n_max, ...)`` and their
    :class:`Gathered` (see the module docstring). Raises ``UnsupportedLayerError``."""
    b = engine.expected_batch_size
    if not _token_rows(x) and (not isinstance(x, torch.Tensor) or x.dim() < 1 or b is None or x.shape[0] == b
                               or _own_layout(hook, x, extra, b)):
        seed(x, b)
        return x, None
    rows = rows_of(x)
    if rows is None:
        lost = lost_at(x)
        if lost is not None:
            raise refusal(hook, x, f"computed from the micro-batch through {lost!r}, an operation after which "
                                   "the engine cannot tell each row's example")
        return x, None  # not from the batch at all: batch_checked_input refuses it as before
    engine.tracking.seen = True
    if rows.b != b:
        raise refusal(hook, x, f"rows of {rows.b} examples, but the micro-batch has {b}")
    if not hook.rule.rows_independent or hook.rule.multi_input or extra[0] or extra[1]:
        what = f"{rows.m} rows per example" if rows.blocks else "rows gathered from the examples by an index"
        raise refusal(hook, x, f"{what}; its rule ({type(hook.rule).__name__}) does not compute each row alone, "
                               "so its rows cannot be laid out per example")
    if rows.blocks:
        return x.reshape(b, rows.m, *x.shape[1:]), rows
    # an expert's gate and up projections read the same rows: laid out once (their ghost norms then share the
    # input's Gram, maths.InputGrams)
    last = engine.tracking.gathered
    if last is None or last[0] is not x or last[1] != x._version:
        layout = Gathered(rows, x.device)
        last = engine.tracking.gathered = (x, x._version, layout, layout.pad(x))
    return last[3], last[2]


def site_output(out: Any, x: Any, rows: Any) -> Any:
    """A call's output with the rows of its input: viewed back to ``(B·m, ...)`` for a token-major call, read
    back from its slots for gathered rows (``rows`` a :class:`Gathered`); its map (a layer's output rows are its
    input rows) marked for the layers after it."""
    if isinstance(rows, Gathered):
        out, rows = (rows.unpad(out) if isinstance(out, torch.Tensor) else out), rows.rows
    elif rows is not None and isinstance(out, torch.Tensor):
        out = out.reshape(rows.rows, *out.shape[2:])
    src = rows_of(x) if rows is None else rows
    if src is not None and isinstance(out, torch.Tensor) and out.dim() >= 1 and out.shape[0] == src.rows:
        mark(out, src)
    return out


def mark_outputs(out: Any, rows: Optional[Rows]) -> None:
    """Every tensor of ``out`` with ``rows``' rows first gets that map (a generic module's outputs)."""
    if rows is None:
        return
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == rows.rows:
            mark(t, rows)


def token_rows(hook, first: Optional[torch.Tensor], tensors: list, b: Optional[int]) -> Optional[Rows]:
    """For a generic-rule call (``generic.py``): the map of a token-major call's rows, or ``None`` for a call with
    the micro-batch first (or none at all, which the caller refuses). Every tensor argument with as many rows must
    have the same map; gathered rows are allowed (the rule recomputes each example on its rows). Raises
    ``UnsupportedLayerError``."""
    if first is None or b is None or (first.shape[0] == b and not _token_rows(first)):
        return None
    rows = rows_of(first)
    if rows is None:
        lost = lost_at(first)
        if lost is not None:
            raise refusal(hook, first, f"computed from the micro-batch through {lost!r}, an operation after which "
                                       "the engine cannot tell each row's example")
        return None
    if rows.b != b:
        raise refusal(hook, first, f"rows of {rows.b} examples, but the micro-batch has {b}")
    for t in tensors:
        if t.dim() >= 1 and t.shape[0] == rows.rows and not (rows_of(t) is not None and rows_of(t).same(rows)):
            raise refusal(hook, t, "an argument with as many rows as the first whose rows the engine cannot tie to "
                                   "the same examples")
    hook.engine.tracking.seen = True
    return rows
