"""Clipping functions, per-group thresholds and group-wise membership (docs/design.md, *The mechanism*).

A clipping function maps per-example gradient norms ``‖g_i‖`` (shape ``(B,)``, fp32) and a threshold
``C`` to coefficients ``c_i`` so that the clipped gradient is ``c_i · g_i`` with ``‖c_i g_i‖ ≤ C``:

* ``"abadi"``: ``c_i = min(1, C / ‖g_i‖)`` (Abadi et al., 2016, Alg. 1).
* ``"automatic"``: ``c_i = C / (‖g_i‖ + γ)`` (Bu et al., "Automatic clipping", 2023), ``γ = 0.01``.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Literal

import torch

from ..util.options import Clipping, ClippingFn, ClippingMode, check_option
from .coverage import children_read_directly


def validate_clipping(clipping: str, clipping_fn: str, max_grad_norm: float, gamma: float,
                      clipping_mode: str = "book-keeping") -> None:
    """Raise ``ValueError`` naming the bad setting and the allowed values."""
    check_option("clipping", clipping, Clipping)
    check_option("clipping_fn", clipping_fn, ClippingFn)
    check_option("clipping_mode", clipping_mode, ClippingMode)
    if clipping_mode == "two-pass" and clipping == "layer-wise":
        raise ValueError("clipping_mode='two-pass' is for clipping='all-layer' or 'group-wise': layer-wise clipping "
                         "forms each layer's clipped gradient in its own backward and keeps nothing for a second "
                         "pass. Leave clipping_mode at 'book-keeping'.")
    if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm (C) must be > 0 (math.inf disables clipping), got {max_grad_norm!r}.")
    if not gamma > 0:
        raise ValueError(f"automatic clipping needs gamma > 0, got {gamma!r}.")
    if clipping_fn == "automatic" and math.isinf(max_grad_norm):
        raise ValueError("clipping_fn='automatic' needs a finite max_grad_norm; use 'abadi' with C=inf to disable.")


def validate_clipping_groups(clipping: str, clipping_groups, group_max_grad_norms, max_grad_norm: float) -> None:
    """Refuse ``clipping_groups`` without ``clipping="group-wise"`` (or the reverse), a string other than
    ``"param_groups"``, and group thresholds above ``max_grad_norm`` (:func:`validate_group_thresholds`).
    Raises ``ValueError`` with the fix."""
    if clipping == "group-wise" and clipping_groups is None:
        raise ValueError("clipping='group-wise' needs clipping_groups: lists of parameter-name patterns, e.g. "
                         "[['encoder.*'], ['head.*']], or 'param_groups' (the optimizer's parameter groups).")
    if clipping_groups is not None and clipping != "group-wise":
        raise ValueError(f"clipping_groups is only used with clipping='group-wise', not {clipping!r}.")
    if isinstance(clipping_groups, str):
        check_option("clipping_groups", clipping_groups, Literal["param_groups"],
                     "Or give lists of parameter-name patterns, e.g. [['encoder.*'], ['head.*']].")
    if group_max_grad_norms is not None:
        validate_group_thresholds(group_max_grad_norms, max_grad_norm)


def validate_group_thresholds(thresholds, max_grad_norm: float) -> None:
    """Refuse group thresholds C_k whose joint bound √(Σ C_k²) on an example's norm exceeds ``max_grad_norm``,
    to which the noise is calibrated (σ·C). Raises ``ValueError`` naming the bound and the fix."""
    bound = math.sqrt(sum(float(c) ** 2 for c in thresholds))
    if bound > max_grad_norm * (1 + 1e-9):
        raise ValueError(
            f"group_max_grad_norms={list(thresholds)} bound each example's gradient norm by sqrt(sum C_k^2) = "
            f"{bound:.6g}, above max_grad_norm = {max_grad_norm:g}, to which the noise is calibrated: set "
            f"max_grad_norm={bound:.6g}, or lower the group thresholds.")


def clip_coefficients(norms: torch.Tensor, max_norm: float, clipping_fn: str, gamma: float = 0.01,
                      scale: float = 1.0) -> torch.Tensor:
    """Per-example coefficients ``scale · c_i`` (shape ``(B,)``, fp32) for norms of shape ``(B,)``.

    With ``max_norm = inf`` and ``"abadi"`` every coefficient is exactly ``scale`` (no clipping). ``scale``
    (default 1) rides on the division the coefficients take anyway: the engine hands the per-example factor
    and the emit scale here rather than multiplying every sum by them.
    """
    norms = norms.float()
    if clipping_fn == "automatic":
        return (max_norm * scale) / (norms + gamma)
    if math.isinf(max_norm):
        return torch.full_like(norms, scale)
    # C / max(‖g_i‖, C) = min(1, C/‖g_i‖): 1 for ‖g_i‖ ≤ C, never 0/0, three kernels a group
    return (max_norm * scale) / norms.clamp(min=max_norm)


def clip_coefficients_sq(sq: torch.Tensor, max_norm: float, clipping_fn: str, gamma: float = 0.01,
                         scale: float = 1.0, factored: bool = False):
    """:func:`clip_coefficients` of the norms ``sqrt(sq)``, from the squared norms ``sq`` (B,): for ``"abadi"``
    ``scale · C · rsqrt(max(‖g_i‖², C²))``, three kernels and no square root of its own (a group's coefficients
    are formed at every layer in layer-wise clipping, so their kernels count). ``factored=True``: ``(c, f)``,
    the coefficients ``f · c`` with the constant ``f`` (``scale · C`` for ``"abadi"``, else 1) left for the
    product that forms the clipped sums to apply (``LayerRule.scales_sums``): two kernels."""
    sq = sq.float()
    c, f = None, 1.0
    if clipping_fn != "abadi":
        c = clip_coefficients(sq.sqrt(), max_norm, clipping_fn, gamma, scale)
    elif math.isinf(max_norm):
        c = torch.full_like(sq, scale)
    else:
        c, f = sq.clamp(min=max_norm * max_norm).rsqrt_(), max_norm * scale
    if factored:
        return c, f
    return c if f == 1.0 else c.mul_(f)


def layer_thresholds(max_grad_norm: float, num_groups: int) -> float:
    """Even split ``C_k = C / sqrt(K)`` so that ``C_tot = sqrt(Σ C_k²) = C`` (docs/design.md, *The mechanism*)."""
    return max_grad_norm / math.sqrt(max(num_groups, 1))


def match_groups(named, groups) -> list[list[torch.nn.Parameter]]:
    """The members of each group of ``clipping="group-wise"``: ``named`` is ``(name, parameter)`` of every
    trainable parameter, ``groups`` lists of ``fnmatch`` name patterns or parameters; a parameter joins the
    first group that matches it. Raises ``ValueError`` for no groups, an unclaimed parameter or an empty group."""
    if not groups:
        raise ValueError("clipping='group-wise' needs groups: lists of parameter-name patterns (e.g. "
                         "[['encoder.*'], ['head.*']]) or clipping_groups='param_groups'.")
    members: list[list[torch.nn.Parameter]] = [[] for _ in groups]
    unclaimed = []
    for name, p in named:
        for k, spec in enumerate(groups):
            if any((s is p) if isinstance(s, torch.Tensor) else fnmatch.fnmatchcase(name, s) for s in spec):
                members[k].append(p)
                break
        else:
            unclaimed.append(name)
    if unclaimed:
        raise ValueError(f"clipping='group-wise': no group claims the trainable parameters {unclaimed}; add "
                         "a pattern for them (e.g. a last group ['*']).")
    empty = [k for k, m in enumerate(members) if not m]
    if empty:
        raise ValueError(f"clipping='group-wise': groups {empty} match no trainable parameter.")
    return members


def _child_path(module: torch.nn.Module, name: str, read_directly: frozenset) -> str:
    """The child of ``module`` whose parameter ``name`` is, when that child is one the forward reads without
    calling it (``read_directly``: Mamba's ``conv1d``, ``dt_proj``); ``""`` otherwise: the module's own layer (a
    parametrization's sources, ``nn.MultiheadAttention``'s ``out_proj``, a rule's other children)."""
    path = name.rpartition(".")[0]
    return path if path.partition(".")[0] in read_directly else ""


def form_groups(clipping: str, hooks, named, groups, group_max_grad_norms, max_grad_norm: float
                ) -> tuple[list[list[torch.nn.Parameter]], list[float]]:
    """The clipping groups and their thresholds C_k: all-layer one group of every trainable parameter (``named``:
    (name, parameter) pairs), layer-wise one per attached layer (``hooks``; a tied parameter joins its first
    layer), group-wise :func:`match_groups` of ``groups``. Thresholds are ``group_max_grad_norms`` (one positive
    value per group, checked by :func:`validate_group_thresholds`) or C/sqrt(K) each.

    Raises:
        ValueError: thresholds of the wrong number or not positive, or above C together.
    """
    if clipping == "all-layer":
        members = [[p for _, p in named]]
    elif clipping == "layer-wise":
        owner: dict[int, tuple[int, str]] = {}
        for k, h in enumerate(hooks):
            params = h.rule.params(h.module)
            names = getattr(h.rule, "param_names", ())
            # a child's parameters that the layer's forward reads directly (dotted names: Mamba's conv1d.weight)
            # are that child's layer, as if it were called; a parametrization's sources
            # (parametrizations.weight.original0) are the layer's own, one group with its bias
            direct = frozenset(n for n, _ in children_read_directly(h.module)) if names else frozenset()
            paths = ([_child_path(h.module, n, direct) for n in names] if len(names) == len(params)
                     else [""] * len(params))
            for p, path in zip(params, paths):
                if p is not None and p.requires_grad:
                    owner.setdefault(id(p), (k, path))
        by_hook: dict[tuple[int, str], list] = {}
        for _, p in named:
            by_hook.setdefault(owner[id(p)], []).append(p)
        members = list(by_hook.values())
    else:
        members = match_groups(named, groups)
    if group_max_grad_norms is None:
        return members, [layer_thresholds(max_grad_norm, len(members))] * len(members)
    if len(group_max_grad_norms) != len(members) or not all(c > 0 for c in group_max_grad_norms):
        raise ValueError(f"group_max_grad_norms needs {len(members)} positive thresholds, one per group, "
                         f"got {list(group_max_grad_norms)}.")
    validate_group_thresholds(group_max_grad_norms, max_grad_norm)
    return members, [float(c) for c in group_max_grad_norms]


class ClipStats:
    """The clipping statistics since the last reset: ``examples``, ``clipped`` (total norm above C: the example's
    update was scaled down) and ``norm_sum`` (of the total norms). The counts stay on the device, summed there, until
    :meth:`read`: one device-to-host read when asked, none per backward (a read waits for the device)."""

    def __init__(self) -> None:
        self._host = {"examples": 0, "clipped": 0, "norm_sum": 0.0}
        self._pending = None  # (2,) fp64 on the device: Σ clipped, Σ norms

    def add(self, norms: torch.Tensor, max_grad_norm: float) -> None:
        """One backward's per-example total norms ``(B,)``."""
        self._host["examples"] += int(norms.numel())
        both = torch.stack([(norms > max_grad_norm).to(norms.dtype), norms]).sum(1, dtype=torch.float64)
        self._pending = both if self._pending is None else self._pending.add_(both)

    def read(self) -> dict:
        if self._pending is not None:
            clipped, norm_sum = self._pending.tolist()
            self._pending = None
            self._host["clipped"] += int(clipped)
            self._host["norm_sum"] += norm_sum
        return self._host
