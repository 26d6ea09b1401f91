"""The mixing checks: in the mode training runs in, and before each micro-batch's update, that no example's
layer inputs or loss depend on the other examples (docs/reliability.md, *What the per-example check proves*).

The layout check (``layout.py``) proves at the first micro-batch that every layer's input is batch first and
per example. Two kinds of mixing escape a check made once in eval mode: a forward that mixes only in training
mode (``x - x.mean(0)`` under ``if self.training``), and one that starts to mix later (mixup after a warm-up).
A third is after the last layer, in the loss: a mean over every token of the micro-batch (Hugging Face's
``labels=`` loss, ``F.cross_entropy`` over flattened ``(B·T)`` tokens) weights example i's gradient by
``B·T_i/ΣT_j``, so one example's influence is no longer bounded by the clipping norm.

So every forward of the checks runs in the module's own training mode, with only the modules that draw random
numbers in training mode (dropout, the dropout of RNNs and of ``nn.MultiheadAttention``, and Hugging Face's
modules, whose attention calls ``F.dropout`` itself when in training mode) switched to eval, and
from one random state (``torch.random.fork_rng``): two forwards of the same examples then compute the same rows.
On top of the layout check's forwards, the *spot check* (:func:`spot_lines`) runs the forward on two examples
``j, k`` of the micro-batch together and on each alone, and requires

* each layer input's rows of ``j`` and ``k`` to be the rows the full micro-batch gave them (row-summaries as in
  ``layout.py``): a statistic over the batch, mixup or attention across examples changes them;
* the loss of the pair to be the mean (``loss_reduction="mean"``) or sum of the two losses alone: a loss that
  mixes examples, or is a mean over tokens, breaks it whenever the two examples' losses and lengths differ;

and a Hugging Face model called with ``labels=`` holding the ignore index, whose loss the step returns, is
refused outright (:func:`labels_watch`): its loss is a mean over the micro-batch's tokens even when the two
losses happen to be close. With ``layout_check="every-batch"`` (the default) the spot check runs on every
micro-batch, with a forward of the full micro-batch as its reference (:func:`run_spot_check`); its cost is on
docs/reliability.md. Which two examples is drawn from a generator of its own (the user's random stream is not
advanced); on one example the pair is that example twice, so every rank runs the same forwards (ZeRO-3's gathers).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from .broadcast import mark_shared_indices
from .layout import (HALF_TOL, TOL, _failures, _record, _Vectors, agree_or_raise, index_map, layer_lines,
                     loss_value)
from .parameters import ParameterHook

#: modules that draw random numbers in training mode and compute the same function in eval mode otherwise
RANDOM_IN_TRAINING = (nn.modules.dropout._DropoutNd, nn.RNNBase, nn.MultiheadAttention)
#: the labels Hugging Face's losses ignore (the padding of its collators)
IGNORE_INDEX = -100


def _random_in_training(m: nn.Module) -> bool:
    # Hugging Face's attention draws its dropout with F.dropout(p if self.training else 0.0) in the attention
    # module itself; its modules differ between the modes by dropout (and checkpointing) only
    return isinstance(m, RANDOM_IN_TRAINING) or type(m).__module__.startswith("transformers.")


@contextmanager
def check_modes(module: nn.Module) -> Iterator[None]:
    """The check's mode: every submodule as it is (training mode stays on), except :data:`RANDOM_IN_TRAINING`
    and the modules of the ``transformers`` package, switched to eval so that the forwards draw no dropout
    mask; all modes restored after."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        for m in module.modules():
            if _random_in_training(m):
                m.training = False
        yield
    finally:
        for m, mode in modes:
            m.training = mode


class _LabelsWatch:
    """Calls of Hugging Face modules given ``labels=`` with the ignore index, and their outputs' loss."""

    def __init__(self):
        self.seen: list[tuple[str, Optional[tuple[float, bool]]]] = []

    def hook(self, module, args, kwargs, out) -> None:
        labels = kwargs.get("labels")
        if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and bool((labels == IGNORE_INDEX).any()):
            self.seen.append((type(module).__name__, loss_value(out)))

    def lines(self, returned: Optional[tuple[float, bool]]) -> list[str]:
        """The refusal, if the step's loss (``returned``) is the loss of such a call."""
        for cls, loss in self.seen:
            if returned is not None and loss is not None and abs(loss[0] - returned[0]) <= 1e-6 * max(1, abs(loss[0])):
                return [f"{cls} was called with labels= padded with {IGNORE_INDEX} and the training step returns its "
                        "loss: Hugging Face averages it over every token of the micro-batch, so example i's gradient "
                        "is scaled by B·T_i/ΣT_j (its share of the tokens) and depends on the other examples, and "
                        "clipping no longer bounds one example's influence. Fix: call the model without labels= and "
                        "return lightning_dpzero.losses.causal_lm_loss(outputs.logits, labels) (token_loss for "
                        "sequence-to-sequence and token classification, with decoder_input_ids="
                        "model.prepare_decoder_input_ids_from_labels(labels)): each sequence's mean token loss, "
                        "averaged over the examples"]
        return []


@contextmanager
def labels_watch(module: nn.Module) -> Iterator[_LabelsWatch]:
    """Watch the forwards run inside for Hugging Face modules (those of the ``transformers`` package) called
    with padded ``labels=``; ``watch.lines(loss)`` is the refusal if the step returned such a loss."""
    watch = _LabelsWatch()
    handles = [m.register_forward_hook(watch.hook, with_kwargs=True) for m in module.modules()
               if type(m).__module__.startswith("transformers.")]
    try:
        yield watch
    finally:
        for h in handles:
            h.remove()


def spot_index(b: int, draw: int) -> Optional[torch.Tensor]:
    """The two examples ``[j, k]`` of the ``draw``-th spot check of a micro-batch of ``b``: distinct, drawn
    from a generator seeded by ``draw`` (``[0, 0]`` for one example, ``None`` for none)."""
    if b < 1:
        return None
    if b == 1:
        return torch.zeros(2, dtype=torch.long)
    return torch.randperm(b, generator=torch.Generator().manual_seed(draw))[:2]


def _sub_failures(ref, sub, index: torch.Tensor, b: int) -> list[tuple[Any, str]]:
    """Layers whose input in the sub-batch ``index`` is not the full micro-batch's rows ``index``. The layout
    check proved the layout; an argument that no example owns (a mask, a ``(1, T)`` position) must not change."""
    if [h for h, _ in ref.calls] != [h for h, _ in sub.calls]:
        return _failures(ref, sub, index, b)[:1]  # its "calls" cause names the first layer that differs
    out = []
    for (hook, rows), (_, sub_rows) in zip(ref.calls, sub.calls):
        for k, ((r0, _), (n0, _)) in enumerate(zip(rows, sub_rows)):
            broadcast = r0.shape[0] == 1 and b != 1 and hook.rule.broadcast_batch
            must_batch = k == 0 and not isinstance(hook, ParameterHook) and not broadcast
            if r0.shape[0] == b and not broadcast and r0.matches(n0, index):
                continue
            if not must_batch and r0.matches(n0):
                continue
            out.append((hook, "mixed" if r0.shape[0] == b else "not batch first"))
            break
    return out


def _loss_lines(pair, alone: list, index: torch.Tensor, reduction: str, half: bool) -> list[str]:
    """The loss check's failure line, if any; ``half``: some layer computed in 16 bits (a float32 loss of
    16-bit logits rounds as they do)."""
    if pair is None or any(a is None for a in alone) or not all(math.isfinite(v[0]) for v in (pair, *alone)):
        return []  # a NaN or infinite loss: the non-finite-loss check stops the step, with the step charged
    (p, p16), (a, a16), (c, c16) = pair, *alone
    tol = (HALF_TOL if half or p16 or a16 or c16 else TOL) * (abs(a) + abs(c)) + 1e-12
    want, other = (a + c, (a + c) / 2) if reduction == "sum" else ((a + c) / 2, a + c)
    if abs(p - want) <= tol:
        return []
    j, k = (int(i) for i in index)
    if abs(p - other) <= tol:
        name, fix = (("sum", "mean") if reduction == "mean" else ("mean", "sum"))
        return [f"the loss is the {name} of the per-example losses (examples {j} and {k}: {p:.6g} together, "
                f"{a:.6g} and {c:.6g} alone), but loss_reduction={reduction!r}. Fix: "
                f"DPDeepSpeedStrategy(loss_reduction={name!r}), or return the {fix}"]
    return [f"the loss mixes examples: examples {j} and {k} give {p:.6g} together but {a:.6g} and {c:.6g} alone "
            f"(their {'sum' if reduction == 'sum' else 'mean'} should be {want:.6g}); a mean over every token of "
            "the micro-batch (F.cross_entropy over (B·T) flattened tokens with padding) weights each example by "
            "its number of tokens, and an in-batch or contrastive loss couples them. Fix: return the "
            f"{'sum' if reduction == 'sum' else 'mean'} over examples of per-example losses, e.g. "
            "lightning_dpzero.losses.causal_lm_loss(logits, labels) for a language model"]


def spot_lines(engine, run_forward: Callable[[Optional[torch.Tensor]], Any], ref, b: int, vectors: _Vectors,
               draw: int) -> list[str]:
    """The spot check against ``ref`` (the recorded forward of the full micro-batch): three forwards (examples
    ``j, k`` together, each alone; see the module docstring). Returns the failure lines, one per cause."""
    index = spot_index(b, draw)
    # A model with shared values (parameters used directly, embeddings on shared indices: broadcast.py) runs the
    # pair only: in a forward of one example every operation's output has the batch's size 1, so where the
    # forward broadcasts a shared value cannot be told apart, and the loss check (which needs each alone) is left
    # to the first micro-batch's full check of the layers; the pair still checks every layer's input rows, in a
    # micro-batch of two or more examples (the full micro-batch's forward of one example is as ambiguous).
    alone = not any(getattr(h, "shared", False) or h.__dict__.get("shared_indices") for h in engine.hooks)
    parts = ((0, 1), (0,), (1,)) if alone else ((0, 1),)
    subs = [None if index is None else index[list(part)] for part in parts]
    recs = [_record(engine, run_forward, sub, b, vectors) for sub in subs]
    if index is None or (not alone and b < 2):  # (the pair's forward still ran: every rank runs the same ones)
        return []
    failures = []
    for sub, rec in zip(subs, recs):
        failures += [f for f in _sub_failures(ref, rec, sub, b) if f not in failures]
    if failures:  # the loss of a forward that mixes examples mixes them too: the layers are the cause
        return layer_lines(engine, failures)
    if not alone:
        return []
    half = any(r0.exact is None and r0.tol == HALF_TOL for _, rows in ref.calls for r0, _ in rows)
    return _loss_lines(recs[0].loss, [recs[1].loss, recs[2].loss], index, engine.loss_reduction, half)


def run_spot_check(engine, run_forward: Callable[[Optional[torch.Tensor]], Any], batch_size: Optional[int],
                   collectives, draw: int, what: str) -> None:
    """The check of a micro-batch after the first: the full micro-batch's forward, then :func:`spot_lines`
    (four forwards without gradients; ``draw`` picks the two examples, ``what`` names the micro-batch), agreed
    over the ranks in one all-reduce. Raises ``UnsupportedLayerError`` on every rank if one failed."""
    b = int(batch_size) if batch_size is not None else 0
    vectors = _Vectors()
    with check_modes(engine.module):
        with labels_watch(engine.module) as watch:
            ref = _record(engine, run_forward, None, b, vectors)
        lines = watch.lines(ref.loss) + spot_lines(engine, run_forward, ref, b, vectors, draw)
    agree_or_raise(engine, lines, b, False, collectives, what)


def run_layout_check(engine, run_forward: Callable[[Optional[torch.Tensor]], Any], batch_size: Optional[int],
                     collectives=None) -> bool:
    """Run the check once (the forwards of ``layout.py``'s docstring and :func:`spot_lines`) and agree over
    the ranks.

    Args:
        engine: the attached :class:`~lightning_dpzero.per_sample.PerSampleEngine`.
        run_forward: ``run_forward(index)`` runs the forward (e.g. the user's ``training_step``) on the
            micro-batch, re-indexed by ``index`` (``None``: as it is; see :func:`reindex_batch`).
        batch_size: B, the micro-batch's number of examples (0 and 1 are checked only for batch dimensions).
        collectives: the ranks (``world_size`` and ``reduce(tensor, reduce_op="sum")``, as any Lightning
            strategy); ``None`` for one process.

    Returns:
        Whether every rank has now passed the check with two or more examples (else call it again at the
        next micro-batch).

    Raises:
        UnsupportedLayerError: the check failed on this rank, or on another (the same number of forwards ran on
            every rank, so ZeRO-3's collective gathers stay matched).
    """
    b = int(batch_size) if batch_size is not None else 0
    s = index_map(b)
    vectors = _Vectors()
    with check_modes(engine.module):
        with labels_watch(engine.module) as watch:
            ref = _record(engine, run_forward, None, b, vectors)
        new = _record(engine, run_forward, s, b, vectors)
        failures = _failures(ref, new, s, b) if b >= 1 else []
        marked = mark_shared_indices(failures)  # embeddings on shared indices of length B: checked again as such
        lines = layer_lines(engine, [f for f in failures if f[0] not in marked])
        spot = spot_lines(engine, run_forward, ref, b, vectors, draw=0)  # run on every rank (matched gathers)
        lines += watch.lines(ref.loss) + ([] if lines or marked else spot)  # a wrong layout also fails the spot
    passed, again = agree_or_raise(engine, lines, b, b < 2, collectives, "the first micro-batch", bool(marked))
    if again:  # every rank runs the check again (the same number of forwards on each: ZeRO-3's gathers)
        return run_layout_check(engine, run_forward, batch_size, collectives)
    return passed
