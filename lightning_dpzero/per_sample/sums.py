"""The clipped sums ``Σ_i c_i g_i`` of a completed clipping group, from the sites the engine recorded for it.

A group completes when its last site has run backward (``PerSampleEngine._complete``): its per-example norms
give the coefficients ``c_i`` (``clipping.clip_coefficients``), then each recorded site's rule forms its part
of the group's clipped sum. The sums are either returned through autograd from the completing site
(:func:`clipped`: layer-wise) or written into ``p.grad`` when the backward pass ends (:func:`write_clipped`:
all-layer and group-wise book-keeping, Bu et al. 2023), site by site so that each site's records are freed as
soon as its sums are formed. Two-pass clipping's second pass forms each site's sums with :func:`site_clipped`
(``two_pass.py``). See docs/design.md, *The factors on the loss*, for ``site.scale`` and ``emit_scale``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .base import Site
from .maths import param_shape


def site_clipped(engine, site: Site, ids: set[int], coef: torch.Tensor, by_id: Optional[dict] = None,
                 unit: float = 1.0, factor: float = 1.0) -> list[tuple[int, torch.Tensor]]:
    """``(parameter id, Σ_i coef_i · g_i)`` of ``site`` for the parameters ``ids`` (coefficients ``coef`` (B,)
    fp32 that carry ``unit``, the per-example factor times ``emit_scale`` they were formed with; rescaled here
    only for a site whose factor differs). With ``by_id`` (a deferred write: parameter id → parameter) the rule
    may add a sum into ``p.grad`` in place (one addmm for a Linear, no temporary of the weight's size), and that
    parameter is left out of the result. ``factor``: a constant the coefficients still need (``clip_coefficients_sq``
    factored), applied by the rule's product where it can (``scales_sums``), else here."""
    if site.units is not None:  # privacy units, summed by rows: c_u / n_u for each row of unit u (units.py)
        coef = site.units.coefficients_of_rows(coef)
    own = site.scale * engine.emit_scale
    hook, alpha = site.hook, factor if own == unit else factor * (own / unit)
    rule, mask = hook.rule, [i in ids for i in hook.param_ids]
    dtype = site.dtype  # None: a multi-input rule's records are its own
    if by_id is None or dtype is None:
        grads = (rule.clipped_grads(site, coef, mask, alpha) if alpha != 1.0 and rule.scales_sums
                 else rule.clipped_grads(site, coef if alpha == 1.0 else coef * alpha, mask))
    else:
        into = [engine.window.grad_into(by_id[i], dtype, math.prod(param_shape(by_id[i]))) if m else None
                for i, m in zip(hook.param_ids, mask)]
        grads = rule.add_clipped_grads(site, coef if alpha == 1.0 else coef * alpha, mask, into)
    return [(i, gr) for i, gr in zip(hook.param_ids, grads) if gr is not None]


def clipped(engine, ids: set[int], coef: torch.Tensor, factor: float, records: list[Site], unit: float = 1.0
            ) -> dict[int, torch.Tensor]:
    """Σ over the sites ``records`` of Σ_i factor · coef_i · g_i for the parameters ``ids``, keyed by parameter id
    (what the completing site returns through autograd)."""
    out: dict[int, torch.Tensor] = {}
    for site in records:
        for i, gr in site_clipped(engine, site, ids, coef, unit=unit, factor=factor):
            out[i] = gr if i not in out else out[i] + gr
    return out


def write_clipped(engine, ids: set[int], coef: torch.Tensor, records: list[Site], by_id: dict,
                  unit: float = 1.0) -> None:
    """Deferred writes of group ``ids`` through the engine's window buffer, site by site in backward order:
    each site is dropped as soon as its sums are written, so its input and output gradient are freed before the
    next site's sums are formed (no second copy of the gradients beside every site's records at the end of the
    backward pass). A parameter frozen since attach (``requires_grad=False``, e.g. by a fine-tuning callback) is
    written nothing, as autograd gives it nothing where a site returns its sums; its norm still counted in the
    group's (conservative). Empties ``records``."""
    ids = {i for i in ids if by_id[i].requires_grad}
    records.reverse()
    while records:
        engine.window.write((by_id[i], gr) for i, gr in site_clipped(engine, records.pop(), ids, coef, by_id, unit))


def total_norms(parts: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
    """Per-example total norms ``(B,)`` from each group's unscaled squared norms and its factor ``(sq, s)``: one
    stack and sum for all groups where they share the factor (the usual case), not one add per group."""
    s = parts[0][1]
    if len(parts) == 1:
        sq = parts[0][0]
    elif all(f == s for _, f in parts):
        sq = torch.stack([t for t, _ in parts]).sum(0)
    else:
        sq, s = torch.stack([t * (f * f) for t, f in parts]).sum(0), 1.0
    return sq.sqrt() * s
