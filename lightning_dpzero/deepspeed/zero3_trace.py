"""ZeRO-3's parameter-release decisions kept in step with its module trace (docs/design.md, *ZeRO-3's trace
and forward-only passes*).

ZeRO-3 records the order in which the modules run in one forward and backward pass (its *trace*); once the trace is
complete it prefetches parameters in that order and, at the end of each module, releases the parameters that the
trace does not use again soon. DeepSpeed (0.19) caches each release decision per (module, position in the trace)
in a ``functools.lru_cache`` that nothing clears when the trace is invalidated and recorded again. A pass without
a backward before training completes a trace of the forward alone: the engine's layout check (forwards without
gradients at the first micro-batch, and at every one with ``layout_check="every-batch"``) or Lightning's validation sanity check. Against that trace, every
parameter is released at the end of its module's forward, and those decisions stay cached for the whole fit once
the trace of the forward and backward replaces it: every backward then gathers those parameters again, one module
at a time and without prefetch (on the benchmark GPT with width 768: 15 more all-gathers per step, 100 ms of a
2.5 s step waiting in them, against 4 ms without DP).

:func:`keep_release_decisions_fresh` clears that cache when a forward starts with a trace that has just become
complete, so the decisions are taken again against the trace that is in use. Only which parameters stay gathered
changes (memory and time, as in plain ZeRO-3 training); what is computed does not. Where the DeepSpeed version
has no such cache, nothing is done.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

_RELEASE_DECISIONS = "_PartitionedParameterCoordinator__params_to_release"


def release_decisions_cache() -> Optional[Callable[[], None]]:
    """The ``cache_clear`` of ZeRO-3's cached release decisions, or ``None`` where this DeepSpeed has none (the
    cached function may sit under DeepSpeed's NVTX wrapper, which keeps it in its closure)."""
    try:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    except ImportError:  # pragma: no cover - DeepSpeed is a dependency
        return None
    fn = PartitionedParameterCoordinator.__dict__.get(_RELEASE_DECISIONS)
    for candidate in [fn, *(c.cell_contents for c in (getattr(fn, "__closure__", None) or ()))]:
        if callable(getattr(candidate, "cache_clear", None)) and callable(getattr(candidate, "cache_info", None)):
            return candidate.cache_clear
    return None


def param_coordinator(deepspeed_engine) -> Any:
    """The ZeRO-3 parameter coordinator of ``deepspeed_engine``, or ``None`` (another stage, or none found)."""
    offload = getattr(getattr(deepspeed_engine, "optimizer", None), "parameter_offload", None)
    get = getattr(offload, "get_param_coordinator", None)
    return get() if callable(get) else None


def keep_release_decisions_fresh(deepspeed_engine) -> Any:
    """On ZeRO-3: a forward pre-hook on the module ``deepspeed_engine`` wraps, run after DeepSpeed's own (which
    resets and completes the trace), that clears the cached release decisions when the trace has become complete
    since the previous forward. Returns the hook's handle, or ``None`` where there is nothing to do (another
    stage, or a DeepSpeed without the cache)."""
    coordinator = param_coordinator(deepspeed_engine)
    clear = release_decisions_cache()
    if coordinator is None or clear is None or not callable(getattr(coordinator, "is_complete_trace", None)):
        return None
    seen = {"complete": bool(coordinator.is_complete_trace())}

    def before_forward(module, args) -> None:
        complete = bool(coordinator.is_complete_trace())
        if complete and not seen["complete"]:
            clear()
        seen["complete"] = complete

    return deepspeed_engine.module.register_forward_pre_hook(before_forward)


#: the per-module counters ZeRO-3's backward hooks (DeepSpeed 0.19) count down once per backward pass: the
#: pre-backward gathers a module's parameters while ``applied_pre_backward_ref_cnt`` is positive, the
#: post-backward releases them when ``ds_grads_remaining`` reaches zero
_BACKWARD_COUNTERS = ("applied_pre_backward_ref_cnt", "ds_grads_remaining")


def backward_counters(module) -> list[tuple[Any, str, int]]:
    """The values of ZeRO-3's per-module backward counters (:data:`_BACKWARD_COUNTERS`) on ``module`` and its
    children after a forward, as ``(module, name, value)``; empty on other stages (no module has them)."""
    return [(m, name, m.__dict__[name]) for m in module.modules() for name in _BACKWARD_COUNTERS
            if isinstance(m.__dict__.get(name), int)]


@contextmanager
def another_backward_follows(deepspeed_engine) -> Iterator[None]:
    """Run a backward pass that DeepSpeed's own backward of the same forward follows (two-pass clipping's norms
    pass), and leave ZeRO-3 as that forward left it: its per-module backward counters back to their values after
    the forward, and the parameters its backward hooks left gathered released. Nothing is done off ZeRO-3
    (``deepspeed_engine`` ``None`` or of another stage).

    ZeRO-3 counts, per module, the backward passes it expects from one forward: one. The first pass used them
    up, so in the second the post-backward hooks, counting below zero, never released a module's parameters:
    every parameter stayed gathered until that pass ended (25.8 M of 25.8 M on a width-1024 GPT, against 4.2 M
    in one pass), and with prefetching off (``stage3_prefetch_bucket_size: 0``) the pre-backward hooks did not
    gather them either, so a layer's backward met its released weight and failed. A module whose inputs need no
    gradient (an embedding) has no post-backward hook; DeepSpeed releases its parameters at the end of its own
    backward (``release_backward_leftovers``), which a pass through ``torch.autograd.grad`` does not reach."""
    module = getattr(deepspeed_engine, "module", None) if deepspeed_engine is not None else None
    coordinator = param_coordinator(deepspeed_engine) if module is not None else None
    saved = backward_counters(module) if coordinator is not None else []
    try:
        yield
    finally:
        for m, name, value in saved:
            m.__dict__[name] = value
        release = getattr(coordinator, "release_backward_leftovers", None)
        if callable(release):
            release()


@contextmanager
def outside_engine_forward(deepspeed_engine: Any) -> Iterator[None]:
    """For a backward inside the DeepSpeed engine's forward (manual optimization: Lightning runs ``training_step``,
    ``manual_backward`` included, inside the engine's forward): ZeRO-3 (DeepSpeed 0.19) marks every module's
    parameters as in a forward, and reading a released parameter as an attribute then all-gathers it and registers
    it as an external parameter of the module running. The engine's backward reads layers' parameters (their
    shapes) after ZeRO-3 released them, on the ranks whose sites do that work only: those gathers would be
    collectives of some ranks alone. For the block the mark is off, as in a backward after the forward."""
    marked = [m._parameters for m in deepspeed_engine.module.modules()
              if getattr(m._parameters, "_in_forward", False)]
    for params in marked:
        params._in_forward = False
    try:
        yield
    finally:
        for params in marked:
            params._in_forward = True
