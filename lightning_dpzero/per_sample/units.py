"""Privacy units: the rows of a micro-batch grouped into the units that are clipped, e.g. a user's examples
(docs/design.md, *The per-example engine*: *Privacy units*).

With user-level DP (Charles et al., "Fine-tuning large language models with user-level differential privacy",
SaTML 2025) the unit whose influence is bounded is a user, who contributes up to k rows of a micro-batch. The
user's gradient is the mean of its rows' per-example gradients,

    g_u = (1/n_u) · Σ_{i ∈ u} g_i ,

and the engine releases Σ_u clip_C(g_u): every row i of unit u gets the coefficient c_u / n_u. A norm of g_u is
not a function of the rows' norms (it needs their cross terms), so each site of the backward pass forms it in one
of two ways:

* **regrouped** (a rule whose per-example gradient is a sum of row contributions that vanish where the output
  gradient is zero: ``LayerRule.rows_independent``, i.e. Linear, Embedding, LayerNorm, RMSNorm): the site's
  input and output gradient are laid out unit-first, ``(B, *rest)`` → ``(U, n_max, *rest)``, each unit's rows in
  its slots, the output gradient weighted by 1/n_u and zero in unused slots. The rule's own ghost norm or
  instantiation and its clipped sums then run unchanged with U "examples" (Σ over a unit's rows and tokens is
  exactly the ghost trick over the union of its tokens, Li et al. 2021);
* **by rows** (every other rule: convolutions, recurrent layers, attention, the generic rule): the rule's
  per-example gradients ``(B, *p)`` are summed per unit with weights 1/n_u, and the clipped sums take the
  per-row coefficients c_{u(i)} / n_{u(i)}.

:class:`Units` holds the row → unit map of one micro-batch. A site whose input rows are not the micro-batch's rows
(a token-major site's, ``token_major.py``, once viewed back batch first) composes its own map with it.
"""

from __future__ import annotations

from typing import Optional

import torch

from .base import Site, UnsupportedLayerError


def slots(index: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each row's slot within its group: its rank among the rows of its group ``index[r]``, in row order
    (``counts``: the rows per group, ``bincount(index)``); ``(R,)`` int64, the position of row r in a
    ``(groups, max(counts), ...)`` layout."""
    order = torch.sort(index, stable=True).indices
    start = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(index)
    slot[order] = torch.arange(index.numel(), device=index.device) - start[index[order]]
    return slot


class Units:
    """The micro-batch's B rows grouped into U privacy units.

    Args:
        unit_of_row: LongTensor ``(B,)``, row i's unit in ``[0, U)``; every id in ``[0, U)`` is used (U is
            ``max + 1``); the rows of a unit need not be adjacent.

    Raises:
        ValueError: ``unit_of_row`` is not a 1-D integer tensor, has negative ids, or skips an id.

    Example:
        >>> units = Units(torch.tensor([0, 1, 0, 2]))
        >>> units.count, units.row_weight.tolist()
        (3, [0.5, 1.0, 0.5, 1.0])
        >>> units.regroup(torch.arange(4.0)).tolist()  # (U, n_max): unit 0 holds rows 0 and 2
        [[0.0, 2.0], [1.0, 0.0], [3.0, 0.0]]
        >>> units.coefficients_of_rows(torch.tensor([1.0, 2.0, 3.0])).tolist()  # c_u / n_u per row
        [0.5, 2.0, 0.5, 3.0]
    """

    def __init__(self, unit_of_row: torch.Tensor):
        if not isinstance(unit_of_row, torch.Tensor) or unit_of_row.dim() != 1 or unit_of_row.is_floating_point() \
                or unit_of_row.dtype == torch.bool:
            raise ValueError(f"units must be a 1-D integer tensor giving each row's unit, got "
                             f"{getattr(unit_of_row, 'dtype', type(unit_of_row).__name__)} of shape "
                             f"{tuple(getattr(unit_of_row, 'shape', ()))}. Fix: pass a LongTensor of shape (B,).")
        index = unit_of_row.long()
        B = index.numel()
        counts = torch.bincount(index) if B else torch.zeros(0, dtype=torch.long, device=index.device)
        if B and (int(index.min()) < 0 or bool((counts == 0).any())):
            raise ValueError("units must number the micro-batch's units 0, 1, ..., U-1, each used by at least one row "
                             f"(got ids {sorted(set(index.tolist()))}). Fix: renumber them, e.g. "
                             "torch.unique(ids, return_inverse=True)[1].")
        self.index, self.count, self.rows = index, int(counts.numel()), B
        self.row_weight = (1.0 / counts.float())[index] if B else torch.zeros(0)
        self.n_max = int(counts.max()) if B else 0
        self.slot = slots(index, counts)
        self._last: Optional[tuple] = None  # (key, source, regrouped): q, k and v read one input, regrouped once

    def to(self, device: torch.device) -> "Units":
        if self.index.device != device:
            self.index, self.slot = self.index.to(device), self.slot.to(device)
            self.row_weight = self.row_weight.to(device)
        return self

    def regroup(self, t: torch.Tensor, weighted: bool = False) -> torch.Tensor:
        """``(B, *rest)`` → ``(U, n_max, *rest)``: row i at ``[unit(i), slot(i)]``, zeros elsewhere; ``weighted``:
        each row times 1/n_u (an output gradient, so that the unit's gradient is its rows' mean)."""
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t._version, weighted)
        if self._last is not None and self._last[0] == key:
            return self._last[2]
        self.to(t.device)
        out = t.new_zeros(self.count, self.n_max, *t.shape[1:])
        rows = t * self.row_weight.to(t.dtype).view(-1, *[1] * (t.dim() - 1)) if weighted else t
        out[self.index, self.slot] = rows
        self._last = (key, t, out)
        return out

    def sum_rows(self, per_example: torch.Tensor) -> torch.Tensor:
        """Per-example tensors ``(B, *p)`` → each unit's mean ``(U, *p)`` (Σ over its rows of 1/n_u · row)."""
        self.to(per_example.device)
        w = self.row_weight.to(per_example.dtype).view(-1, *[1] * (per_example.dim() - 1))
        out = per_example.new_zeros(self.count, *per_example.shape[1:])
        return out.index_add_(0, self.index, per_example * w)

    def coefficients_of_rows(self, coef: torch.Tensor) -> torch.Tensor:
        """Each unit's coefficient ``(U,)`` → each row's ``(B,)``: c_{u(i)} / n_{u(i)}."""
        self.to(coef.device)
        return coef[self.index] * self.row_weight.to(coef.dtype)


def prepare_site(units: Units, site: Site) -> bool:
    """Lay ``site`` out for unit norms: regrouped in place (``site.x``, ``site.g`` unit-first; returns False) for a
    rule whose rows are independent, else marked to be summed by rows (``site.units``; returns True)."""
    rule = site.hook.rule
    x, g = site.x, site.g
    if (rule.rows_independent and not rule.multi_input and isinstance(x, torch.Tensor) and isinstance(g, torch.Tensor)
            and x.dim() >= 1 and g.dim() >= 1 and x.shape[0] == units.rows == g.shape[0]):
        site.x, site.g = units.regroup(x), units.regroup(g, weighted=True)
        site.kept.pop("xhat", None)  # formed from the rows as they were
        return False
    site.units = units
    return True


def per_unit(site: Site, mask: list[bool]) -> list[Optional[torch.Tensor]]:
    """A by-rows site's per-unit mean gradients ``(U, *p)`` per parameter (``None`` where ``mask`` is False)."""
    try:
        per = site.hook.rule.per_example(site, mask)
    except NotImplementedError:
        raise UnsupportedLayerError(
            f"{type(site.module).__name__} '{site.hook.name}': its rule has no per-example gradients, which privacy "
            "units (privacy_unit='user') need for a layer that is not row-wise. Fix: freeze it, or use "
            "privacy_unit='example'.") from None
    return [None if p is None else site.units.sum_rows(p) for p in per]
