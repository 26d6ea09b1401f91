"""Two-pass clipping of groups that span layers (all-layer, group-wise): the per-example norms from a first
backward pass, the clipped gradients from a second (Li et al. 2021's ghost clipping; docs/design.md, *Two-pass
clipping*).

In one backward pass (``clipping_mode="book-keeping"``, Bu et al. 2023) a group that spans layers is complete
only when its last layer has run its backward, so every site of the group keeps its input and output gradient
until then, and the clipped sums ``Σ_i c_i g_i`` are formed at the end of the pass: the memory of one more set
of the layers' activations at the end of the backward pass. ``clipping_mode="two-pass"`` keeps nothing:

1. :func:`norms_pass`: a backward pass through ``torch.autograd.grad`` with the graph retained. Every site takes
   its per-example squared norms (ghost or instantiated, as in one pass), keeps nothing, and returns no
   parameter gradient, so nothing is accumulated into ``p.grad`` and DeepSpeed's reduce hooks do not fire.
   Each group's coefficients ``c_i`` are fixed when its last site has run (or at the end of the pass).
2. the caller's own backward (DeepSpeed's, unchanged): every site returns ``Σ_i c_i g_i`` of its parameters
   at once, through autograd, with the first pass's coefficients (:func:`clip_site`). Nothing is deferred, so
   ZeRO 1–3 reduce these gradients as any others.

The cost is the first pass: the backward of every layer's input gradient a second time, and the norms.
"""

from __future__ import annotations

import torch

from .sums import site_clipped


def norms_pass(engine, loss: torch.Tensor) -> None:
    """Pass 1 of two-pass clipping on ``loss`` (the micro-batch's loss as the caller will hand it to its own
    backward, which is pass 2); a no-op unless ``engine.two_pass``. The graph is retained for pass 2.

    Raises:
        RuntimeError: from autograd, e.g. a graph already freed; the engine is then back to one pass. Naming the
            fix for reentrant activation checkpointing (``use_reentrant=True``), which ``torch.autograd.grad``
            cannot run through.
    """
    if not engine.two_pass:
        return
    # a parameter frozen since attach (a fine-tuning callback) is no input of autograd.grad, which refuses one
    # that does not require grad; its site still takes its norm, as in one pass
    params = [p for group in engine.groups for p in group if p.requires_grad]
    engine.phase = "norms"
    try:
        if params:
            torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        engine.input_grams.clear()  # the second pass takes no norms
    except BaseException as err:
        engine.phase = None
        if not (isinstance(err, RuntimeError) and "use_reentrant=True" in str(err)):
            raise
        raise RuntimeError(
            "clipping_mode='two-pass' takes the norms in a backward pass through torch.autograd.grad, which "
            "activation checkpointing with use_reentrant=True cannot run: checkpoint with use_reentrant=False "
            "(HuggingFace: gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})) "
            "or use clipping_mode='book-keeping'.") from err
    engine.phase = "clip"


def clip_site(engine, site) -> dict[int, torch.Tensor]:
    """Pass 2 at one site: ``Σ_i c_i · g_i`` of each of its parameters, keyed by parameter id, with its group's
    coefficients from pass 1 (``sums.site_clipped``, as a layer-wise site forms them)."""
    out: dict[int, torch.Tensor] = {}
    for k in site.hook.groups:
        entry = engine.pass_coefficients.get(k)
        if entry is None:
            raise RuntimeError(f"Two-pass clipping: {type(site.module).__name__} '{site.hook.name}' ran its backward "
                               "in the second pass but not in the first, so its clipping coefficients are unknown.")
        coef, unit = entry
        out.update(site_clipped(engine, site, engine.group_ids[k], coef, unit=unit))
    return out
