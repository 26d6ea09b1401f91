"""The per-example engine: attaches to a module's supported layers and clips per example (docs/design.md,
*The mechanism* and *The per-example engine*).

Usage without Lightning (the functional API the strategy uses)::

    engine = PerSampleEngine(model, max_grad_norm=1.0, clipping="layer-wise")
    engine.attach()
    engine.check_layout(lambda i: model(x if i is None else x[i]).pow(2).mean(), B)  # once, before training
    with engine.micro_batch(batch_size=B):           # loss = mean of the B per-example losses
        model(x).pow(2).mean().backward()
    # every trainable p.grad now holds Σ_i clip(g_i)  (the *sum* of clipped per-example gradients)

Parameters are split into *clipping groups* (all-layer: one group; layer-wise: one per layer; group-wise:
the user's). Each call of a supported layer is a *site*. A group is complete once every site touching it
has run its backward; then its per-example norms give the coefficients and:

* if every parameter of the group is an input of the completing site (layer-wise, and also a tied or
  reused layer, whose last site returns the sum over all its sites), the clipped gradient is returned
  through autograd from that site, so DeepSpeed's reduce hooks see it like any gradient;
* otherwise (all-layer, a group spanning layers) each site returns nothing (``deferred_zeros``: zeros) and the
  clipped gradients are written into ``p.grad`` at the end of the backward pass (book-keeping, Bu et al. 2023).
  Under ZeRO 1–3 this needs DeepSpeed's coalesced reduction (``needs_deferred_writes``).

A parameter used by several sites (tied weights, a layer called twice) has its per-example gradients
instantiated at each site and summed, so its norm is exact.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from ..util.options import LossReduction, check_option
from .base import LayerHook, Site, UnsupportedLayerError, no_autocast
from .broadcast import on_shared_indices
from .clipping import ClipStats, clip_coefficients_sq, form_groups, validate_clipping
from .coverage import attach_hooks, check_batch_mixing, check_coverage, check_none_unfrozen, install_guards
from .layout import batch_checked_input
from .mixing import run_layout_check, run_spot_check
from . import sums
from .maths import InputGrams
from .paths import InputReaders
from .provenance import seed
from .token_major import Tracking, site_input, site_output
from .two_pass import clip_site, norms_pass
from .units import Units, per_unit, prepare_site
from .window import WindowBuffer

GroupSpec = Sequence[Union[str, nn.Parameter]]


class PerSampleEngine:
    """Per-example clipping for every trainable parameter of ``module``.

    Args:
        module: any ``nn.Module``; every trainable parameter must belong to a supported layer, or be used
            directly by its module's forward and broadcast over the batch (class token, position embedding,
            layer scale; ``parameters.py``, ``broadcast.py``).
        max_grad_norm: C, the bound on each example's total gradient norm (``math.inf``: no clipping).
        clipping: ``"layer-wise"`` (one group per layer), ``"all-layer"`` (one group) or ``"group-wise"``.
        clipping_fn: ``"abadi"`` (``min(1, C/‖g‖)``) or ``"automatic"`` (``C/(‖g‖+γ)``).
        gamma: γ of automatic clipping.
        loss_reduction: ``"mean"`` if the loss is the mean of per-example losses over the micro-batch
            (Lightning's convention), ``"sum"`` if it is their sum.
        groups: for ``"group-wise"``: a list of groups, each a list of parameter-name patterns
            (``fnmatch``, e.g. ``"encoder.*"``) or of parameters; a parameter joins the first group that
            matches it. May also be given later with :meth:`set_groups`.
        group_max_grad_norms: thresholds C_k per group; default C/sqrt(K), so that sqrt(Σ C_k²) = C.
        clipping_mode: how groups that span layers (all-layer, group-wise) are clipped: ``"book-keeping"``
            (default; one backward pass, each layer's input and output gradient kept until the group's last
            layer has run, Bu et al. 2023) or ``"two-pass"`` (the norms from a first backward pass, the clipped
            gradients from a second, keeping nothing: the memory of non-private training, for the time of one
            more backward pass of the input gradients; Li et al. 2021, ``two_pass.py``). Layer-wise clipping
            keeps nothing in either mode and refuses ``"two-pass"``.

    Raises:
        UnsupportedLayerError: from :meth:`attach`, naming each trainable parameter no rule covers; during a
            backward, naming a parameter whose gradient did not come through the engine (used outside its
            layer's forward, or a forward run in ``eval()`` mode), before that gradient is accumulated.
        ValueError: for a bad setting or a parameter no group claims.

    After each backward pass, ``last_norms`` holds the per-example total gradient norms ``(B,)`` fp32,
    ``last_paths`` maps each layer name to the path its rule took for the weight gradient (``"ghost"``,
    ``"instantiate"`` or ``"reuse"``; for a layer called several times, its call whose backward ran last),
    and ``stats`` accumulates ``examples``, ``clipped`` (total norm above C) and ``norm_sum`` until
    :meth:`reset_stats`.
    """

    def __init__(self, module: nn.Module, max_grad_norm: float = 1.0, clipping: str = "layer-wise",
                 clipping_fn: str = "abadi", gamma: float = 0.01, loss_reduction: str = "mean",
                 groups: Optional[Sequence[GroupSpec]] = None,
                 group_max_grad_norms: Optional[Sequence[float]] = None, clipping_mode: str = "book-keeping"):
        validate_clipping(clipping, clipping_fn, max_grad_norm, gamma, clipping_mode)
        check_option("loss_reduction", loss_reduction, LossReduction)
        self.module, self.max_grad_norm, self.clipping = module, float(max_grad_norm), clipping
        self.clipping_fn, self.gamma, self.loss_reduction = clipping_fn, gamma, loss_reduction
        self.clipping_mode, self.two_pass = clipping_mode, False
        self.phase: Optional[str] = None  # two-pass: "norms" during the first backward, "clip" until the second ends
        self.pass_coefficients: dict[int, torch.Tensor] = {}  # two-pass: per group, the first pass's c_i
        self._group_spec, self._group_norms = groups, group_max_grad_norms
        self.hooks: list[LayerHook] = []
        self.tracking = Tracking(self)  # installed by attach
        self._layout = None  # the layout check's recorder while it runs (layout.py)
        self.layout_verified = False  # every rank passed the layout check with two or more examples
        self._checks = 0  # micro-batches checked (layout check, then spot checks: mixing.py)
        self._guards: list = []
        self.active = False
        # post_processing: forwards without the engine (after a private step), a generator's backward under way
        self.public = self.post_processing_backward = False
        # Set per micro-batch by the caller (see ``micro_batch``):
        self.expected_batch_size: Optional[int] = None
        self.stand_in = False  # the forward runs on a stand-in for an empty micro-batch (start_micro_batch)
        self.units: Optional[Units] = None  # the micro-batch's privacy units, None: each row its own (units.py)
        self.grad_scale = 1.0  # observed grad × grad_scale = gradient of the per-example loss (× B for "mean")
        self.emit_scale = 1.0  # multiplies what is written to p.grad (e.g. a loss scale DeepSpeed divides out)
        self.window = WindowBuffer()  # clipped sums held until an accumulation window's boundary (window.py)
        # zeros for deferred parameters only where hooks need a gradient of each in every backward (ZeRO 1-3, 16-bit
        # optimizers); else none, and p.grad appears with its clipped sum (docs/design.md, *The per-example engine*)
        self.deferred_zeros = False
        self._window_mode = False
        self._reset_pass()
        self.reset_stats()
        self.last_norms: Optional[torch.Tensor] = None
        self.last_paths: dict[str, str] = {}

    # ---------------------------------------------------------------- attach / validate
    def attach(self) -> "PerSampleEngine":
        """Replace the forward of each supported layer (instance attribute only), check coverage (invariant
        I5, docs/design.md) and form the clipping groups."""
        if self.hooks:
            return self
        check_batch_mixing(self.module)
        try:
            refused: dict[int, str] = {}
            self.hooks, covered, owned = attach_hooks(self, self.module, refused)
            check_coverage(self.module, covered, owned, refused)
        except UnsupportedLayerError:
            self.detach()
            raise
        self._guards = install_guards(self, self._trainable_named())
        self.tracking = Tracking(self).install(self.module)  # row maps of token-major layers (token_major.py)
        self.active = True
        if self.clipping != "group-wise" or self._group_spec is not None:
            self.set_groups(self._group_spec, self._group_norms)
        return self

    @property
    def zero3_leaf_types(self) -> list[type]:
        """Module types whose rule reads child modules' weights without calling them (e.g. attention's
        ``out_proj``), or whose generic rule re-runs their forward in backward: ZeRO-3 must gather them as one
        leaf (``deepspeed.utils.set_z3_leaf_modules``)."""
        leaves = {type(h.module) for h in self.hooks if h.rule.owned_children or getattr(h, "zero3_leaf", False)}
        return sorted(leaves, key=lambda t: t.__name__)

    def _trainable_named(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]  # tied: first name

    def set_groups(self, groups: Optional[Sequence[GroupSpec]] = None,
                   group_max_grad_norms: Optional[Sequence[float]] = None) -> None:
        """Form the clipping groups (see the class docstring); ``groups`` only for ``"group-wise"``."""
        members, self.group_thresholds = form_groups(self.clipping, self.hooks, self._trainable_named(), groups,
                                                     group_max_grad_norms, self.max_grad_norm)
        self.groups = members
        self.group_of = {id(p): k for k, grp in enumerate(members) for p in grp}
        self.group_ids = [{id(p) for p in grp} for grp in members]
        for h in self.hooks:
            h.param_ids = [id(p) if p is not None and p.requires_grad else None for p in h.rule.params(h.module)]
            h.groups = sorted({self.group_of[i] for i in h.param_ids if i is not None})
            # the groups this site holds every parameter of: it can return their clipped sums through autograd
            h.returnable = {k for k in h.groups if self.group_ids[k] <= set(h.param_ids)}
        # returned through autograd where every site of a group holds all its parameters (two passes: always)
        spans = any(len(h.returnable) < len(h.groups) for h in self.hooks)
        self.two_pass = spans and self.clipping_mode == "two-pass"
        self.needs_deferred_writes = spans and not self.two_pass

    def detach(self) -> None:
        for h in self.hooks:
            if h.module.__dict__.get("forward") is h:
                del h.module.forward
        for handle in self._guards:
            handle.remove()
        self.tracking.remove()
        self.hooks, self._guards, self.active = [], [], False
        self.window.clear()  # a window cut by an exception: nothing held reaches a later fit

    def clipping_now(self) -> bool:
        """Whether a forward now runs through the engine (attached, training mode, gradients enabled)."""
        return self.active and not self.public and torch.is_grad_enabled() and self.module.training

    # ---------------------------------------------------------------- per micro-batch
    @contextlib.contextmanager
    def micro_batch(self, batch_size: int, grad_scale: float = 1.0, emit_scale: float = 1.0,
                    units: Optional[torch.Tensor] = None) -> Iterator[None]:
        """Declare the micro-batch: ``batch_size`` examples, grouped into privacy ``units`` if given; see
        :meth:`start_micro_batch` and :meth:`set_loss_factors`."""
        self.start_micro_batch(batch_size, units=units)
        self.set_loss_factors(grad_scale, emit_scale)
        try:
            yield
        finally:
            self.finalize()
            self.expected_batch_size, self.stand_in, self.units = None, False, None

    def start_micro_batch(self, batch_size: Optional[int], stand_in_rows: int = 0,
                          units: Optional[torch.Tensor] = None) -> None:
        """A micro-batch of ``batch_size`` examples (``None``: read each layer's first input dimension) starts
        its forward: sites of an earlier forward that never ran backward are forgotten. ``stand_in_rows`` > 0:
        the micro-batch is empty and its forward runs on a stand-in of that many rows (a model that cannot run
        zero rows still runs every collective); the stand-in holds no example of the step, so every site hands
        each parameter the clipped sum of no example, zeros, whatever the stand-in's values.

        ``units``: LongTensor ``(B,)``, each row's privacy unit in ``[0, U)`` (user-level DP: a user's rows), or
        ``None`` (each row its own unit). With units, the backward writes Σ_u clip(g_u), g_u the mean of unit u's
        rows' per-example gradients, and :attr:`last_norms` holds the U units' norms (``units.py``).

        Raises:
            ValueError: ``units`` is not a ``(B,)`` integer tensor numbering the units 0 to U-1."""
        check_none_unfrozen(self)
        self.expected_batch_size = stand_in_rows or batch_size
        self.stand_in = stand_in_rows > 0
        self.units = None
        if units is not None and not self.stand_in:
            self.units = Units(units)
            if batch_size is not None and self.units.rows != batch_size:
                raise ValueError(f"units gives {self.units.rows} rows their unit, but the micro-batch has {batch_size} "
                                 "examples. Fix: one unit id per example of the micro-batch.")
        self.new_forward()

    def set_loss_factors(self, grad_scale: float, emit_scale: float) -> None:
        """``grad_scale``: observed output gradient × ``grad_scale`` = gradient of the per-example loss (× B for a
        mean loss); ``emit_scale``: multiplies what is returned or written as a gradient (a loss scale that
        DeepSpeed divides out before the step). See docs/design.md, *The factors on the loss*."""
        self.grad_scale, self.emit_scale = float(grad_scale), float(emit_scale)

    def accumulate_window(self, boundary: bool) -> None:
        """From now on every group's clipped sum is deferred: held in :attr:`window` (fp32) before the
        accumulation ``boundary``, written into ``p.grad`` with what is held at it (window.py)."""
        self._window_mode = True
        self.window.hold = not boundary

    def _returns(self, k: int, hook: LayerHook) -> bool:  # through autograd from hook's site, else deferred
        return k in hook.returnable and not self._window_mode

    def new_forward(self) -> None:
        """Start of a micro-batch's forward: forget sites of an earlier forward that never ran backward."""
        self._reset_pass()
        self.phase, self.pass_coefficients = None, {}

    def norms_pass(self, loss: torch.Tensor) -> None:
        """With ``clipping_mode="two-pass"``: the first backward pass on ``loss``, which fixes every group's
        clipping coefficients; the caller's own backward of ``loss`` then forms the clipped gradients
        (``two_pass.py``). A no-op otherwise. The second backward must start from this same ``loss`` (not a
        rescaled one): the coefficients fixed here bound the gradients that backward forms."""
        norms_pass(self, loss)

    def _reset_pass(self) -> None:
        self._sites_left: dict[int, int] = {}
        self._param_sites: dict[int, int] = {}
        self._group_sq: dict[int, list[torch.Tensor]] = {}
        self._shared_sum: dict[int, torch.Tensor] = {}
        self._records: dict[int, list] = {}
        self._deferred: list = []
        self._emitted: dict[int, torch.Tensor] = {}  # per parameter: Σ of what its sites returned (the guard)
        self._paths: dict[str, str] = {}  # per layer: the path of its weight gradient (``last_paths``)
        self._group_scale: dict[int, float] = {}  # per group: the per-example factor its sums are taken in
        self._total_sq: list[tuple[torch.Tensor, float]] = []  # per completed group: (Σ sq unscaled, its factor)
        self._pending = False
        self.input_grams = InputGrams()  # the ghost norms' input Gram shared by layers reading one input (maths.py)
        self.input_readers = InputReaders()  # how many layers read each input: what a site may keep (paths.py)

    def _forward(self, hook: LayerHook, x: torch.Tensor, extra: tuple[tuple, dict] = ((), {})) -> torch.Tensor:
        """One call of an attached layer (``extra``: a multi-input call's other arguments)."""
        if (shared := on_shared_indices(self, hook, x, extra)) is not None:  # indices with no batch (broadcast.py)
            return shared
        if not self.clipping_now():
            seed(x, self.tracking.examples())
            self._record_call(hook, (x, *extra[0]), extra[1])
            return site_output(hook.original_forward(x, extra), x, None)
        given = x
        x, rows = site_input(self, hook, x, extra)  # token-major rows viewed as (B, m, ...) (token_major.py)
        x = batch_checked_input(hook, x, extra, self.expected_batch_size)
        self._register_site(hook)
        self.input_readers.add(x)
        return site_output(hook.run(x, hook.rule.params(hook.module), extra), given, rows)

    def check_layout(self, run_forward: Callable[[Optional[torch.Tensor]], Any], batch_size: Optional[int],
                     collectives: Any = None, every_batch: bool = False) -> bool:
        """Prove, before the first update, that every layer's input is batch first and per example: forwards
        without gradients in the module's training mode (dropout off), the second on the micro-batch
        re-indexed (``layout.py``), then the spot check: two examples together and each alone, whose layer
        inputs must be the micro-batch's rows and whose losses must add up (``mixing.py``). Call it with the
        micro-batch before its training forward until it returns True (``layout_verified``: every rank has
        passed it with two or more examples); the strategy does so at each fit. ``every_batch``: once proven,
        run the spot check on each later call (before that micro-batch's update), as the strategy does by
        default; else later calls return at once.

        Args:
            run_forward: ``run_forward(index)`` runs the forward and loss on the micro-batch, every tensor of
                it whose first dimension is B indexed by ``index`` (``None``: unchanged), e.g.
                ``lambda i: loss_fn(model(x if i is None else x[i]), y)``; ``layout.reindex_batch`` does it
                for any batch structure.
            batch_size: B.
            collectives: the ranks (any Lightning strategy); ``None`` for one process.
            every_batch: spot-check every later micro-batch (four forwards without gradients each).

        Raises:
            UnsupportedLayerError: naming each layer whose input is not batch first and per example (time
                first, shared by every example, mixing examples), a loss that is not the mean (``loss_reduction
                "sum"``: the sum) of per-example losses, or Hugging Face's token-averaged ``labels=`` loss, and
                the fix.

        Example:
            >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            >>> engine = PerSampleEngine(model).attach()
            >>> x = torch.randn(5, 4)
            >>> engine.check_layout(lambda i: model(x if i is None else x[i]).mean(), batch_size=5)
            True
        """
        self._checks += 1
        if not self.layout_verified:
            self.layout_verified = run_layout_check(self, run_forward, batch_size, collectives)
            if self.layout_verified and self.tracking.needed is None:  # row maps only where a layer needs them
                self.tracking.needed = self.tracking.seen
                if not self.tracking.needed:
                    self.tracking.remove()  # no hook left on the forwards
        elif every_batch:
            run_spot_check(self, run_forward, batch_size, collectives, self._checks, f"micro-batch {self._checks}")
        return self.layout_verified

    def _record_call(self, hook: LayerHook, args: tuple, kwargs: dict) -> None:
        """A call of an attached layer while the engine does not clip: recorded while the layout check runs."""
        if self._layout is not None:
            self._layout.record(hook, args, kwargs)

    def _register_site(self, hook: LayerHook) -> None:
        for k in hook.groups:
            self._sites_left[k] = self._sites_left.get(k, 0) + 1
        for i in hook.param_ids:
            if i is not None:
                self._param_sites[i] = self._param_sites.get(i, 0) + 1

    # ---------------------------------------------------------------- backward
    def _on_backward(self, site: Site, params) -> list[Optional[torch.Tensor]]:
        """A site's backward: its norms, then the clipped gradients it returns (none where deferred)."""
        if self.post_processing_backward:  # post_processing: a generator's loss through a private forward
            raise UnsupportedLayerError(
                f"A post-processing model's backward reached '{site.hook.name}' of a private forward (between a draw "
                "and its step): compute its loss with a forward of the private model after the private step.")
        if self.two_pass and self.phase is None:
            raise RuntimeError("clipping_mode='two-pass' needs the norms first: call engine.norms_pass(loss) "
                               "before loss.backward() (the strategies do).")
        if not self._pending:  # one finalize per backward pass (deferred gradients, statistics)
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
        hook = site.hook
        if self.stand_in:  # no example: each clipped sum is zero, as an empty batch's (no norm is taken)
            zeros = {i: torch.zeros_like(p) for i, p in zip(hook.param_ids, params) if i is not None}
            return [None] * len(params) if self.phase == "norms" else self._returned(hook.param_ids, params, zeros)
        scale = site.scale = self.grad_scale * (site.x.shape[0] if self.loss_reduction == "mean" else 1)
        by_rows = self.units is not None and prepare_site(self.units, site)  # regrouped unit-first, or by rows
        if self.phase == "clip":
            return self._returned(hook.param_ids, params, clip_site(self, site))
        ids = hook.param_ids
        shared = [i is not None and (by_rows or self._param_sites.get(i, 0) > 1) for i in ids]
        plain = [i is not None and not s for i, s in zip(ids, shared)]
        if any(plain):
            # the clipped sum follows at this site: the rule may reuse what its norm instantiated
            site.completes = self._completes_at(hook)
            for i, sq in zip(ids, hook.rule.norm_sq(site, plain)):
                if sq is not None:  # in units of the group's first scale: rescaled only where a site's differs
                    f = self._unit(self.group_of[i], scale)  # listed: one stack and sum per group (_complete)
                    self._group_sq.setdefault(self.group_of[i], []).append(sq if f == 1.0 else sq * (f * f))
        if any(shared):
            for i, pe in zip(ids, per_unit(site, shared) if by_rows else hook.rule.per_example(site, shared)):
                if pe is not None:
                    f = self._unit(self.group_of[i], scale)
                    self._add(self._shared_sum, i, pe if f == 1.0 else pe * f)
        if site.path is not None:
            self._paths[hook.name] = site.path
        if len(hook.groups) == 1 and not any(shared) and hook.rule.releases_rows(site):
            site.release_rows()  # what the rule kept forms the site's sums: x and g need not wait for the group
        out: dict[int, torch.Tensor] = {}
        norms_only = self.phase == "norms"
        for k in hook.groups:
            kept = self._records.setdefault(k, [])
            if not norms_only:  # the first of two passes keeps no site
                kept.append(site)
            self._sites_left[k] -= 1
            if self._sites_left[k] == 0:
                out.update(self._complete(k, hook))
        if norms_only:
            return [None] * len(params)
        return self._returned(ids, params, out)

    def _returned(self, ids: list, params, out: dict[int, torch.Tensor]) -> list[Optional[torch.Tensor]]:
        """What a site's backward returns for its parameters: the sums in ``out``; for the others, which are
        deferred or have none, ``None`` (zeros where ``deferred_zeros``). Recorded for the guard."""
        grads = [None if i is None else out[i] if i in out else torch.zeros_like(p) if self.deferred_zeros else None
                 for i, p in zip(ids, params)]
        for i, gr in zip(ids, grads):
            if gr is not None:
                self._add(self._emitted, i, gr)
        return grads

    def _completes_at(self, hook: LayerHook) -> bool:
        """Every group of this site completes at it and is returned through autograd from it (layer-wise),
        so ``clipped_grads`` for this site runs right after ``norm_sq`` (see ``_complete``)."""
        return self.phase is None and all(self._sites_left.get(k) == 1 and self._returns(k, hook) for k in hook.groups)

    def _unit(self, k: int, scale: float) -> float:
        """A site's per-example factor over its group's (the first its group saw): the norms are summed unscaled
        and the factor applied once, in the coefficients (one op per group, not one per parameter)."""
        s = self._group_scale.setdefault(k, scale or 1.0)  # 0: an empty micro-batch's (B = 0)
        return 1.0 if scale == s else scale / s

    @staticmethod
    def _add(store: dict, key: int, value: torch.Tensor) -> None:
        store[key] = value if key not in store else store[key] + value

    def _complete(self, k: int, hook: Optional[LayerHook]) -> dict[int, torch.Tensor]:
        """Group ``k`` has seen all its sites: coefficients, then its clipped gradients (returned or deferred)."""
        ids = self.group_ids[k]
        parts = self._group_sq.pop(k, [])
        sq = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0) if parts else None
        for i in ids & self._shared_sum.keys():
            s = self._shared_sum.pop(i).flatten(1).pow(2).sum(1)
            sq = s if sq is None else sq + s
        s = self._group_scale.get(k, 1.0)  # the true norms are s·sqrt(sq): the threshold and γ divided by s instead
        self._total_sq.append((sq, s))
        unit = s * self.emit_scale  # the coefficients carry the site's factor and the emit scale (sums.py)
        returned = self.phase != "norms" and hook is not None and self._returns(k, hook)  # their factor: in the sums
        coef = clip_coefficients_sq(sq, self.group_thresholds[k] / s, self.clipping_fn, self.gamma / s, unit, returned)
        records = self._records.pop(k)
        if self.phase == "norms":  # the second pass forms the sums (two_pass.py)
            self.pass_coefficients[k] = (coef, unit)
            return {}
        if returned:
            return sums.clipped(self, ids, *coef, records, unit)
        self._deferred.append((ids, coef, records, unit))
        return {}

    def finalize(self) -> None:
        """End of a backward pass: deferred gradients are added to ``p.grad``, statistics updated."""
        with no_autocast():
            self._finalize()

    def _finalize(self) -> None:
        if self.phase == "clip":  # the second of two passes has ended
            self.phase, self.pass_coefficients = None, {}
        for k in list(self._records):  # a group some of whose sites never ran backward (unused output)
            self._complete(k, None)
        by_id = {id(p): p for grp in self.groups for p in grp} if self._deferred else {}
        deferred, self._deferred = self._deferred, []
        for ids, coef, records, unit in deferred:
            sums.write_clipped(self, ids, coef, records, by_id, unit)
        parts, paths = self._total_sq, self._paths
        self._reset_pass()
        if parts:  # a backward ran (``micro_batch`` calls this again after the queued call)
            self.last_paths = paths
            self._update_stats(sums.total_norms(parts))

    # ---------------------------------------------------------------- statistics
    def reset_stats(self) -> None:
        self._stats = ClipStats()

    @property
    def stats(self) -> dict:
        """``examples``, ``clipped`` (total norm above C) and ``norm_sum`` since :meth:`reset_stats` (read from the
        device when asked: none per backward)."""
        return self._stats.read()

    def _update_stats(self, norms: torch.Tensor) -> None:
        self.last_norms = norms.detach()  # the last backward's per-example total norms, (B,) fp32 (diagnostics.py)
        self._stats.add(self.last_norms, self.max_grad_norm)
