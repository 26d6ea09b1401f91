"""What the Trainer's and Fabric's DP strategies share: their DP settings, checked once when constructed, and the
per-example engine they attach before DeepSpeed wraps the model (docs/design.md, *Where each piece runs*)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from torch import nn

from ..util import known_warnings
from . import refusals, refusal_report
from ..deepspeed.extensions import default_build_dir
from ..util.options import LossReduction, check_flag, check_number, check_option
from ..deepspeed.reduction import output_hook_managers, output_hooks_suspended
from ..deepspeed.zero3_trace import another_backward_follows, keep_release_decisions_fresh
from ..mechanism import DPMechanism
from ..per_sample import PerSampleEngine
from ..per_sample.clipping import validate_clipping, validate_clipping_groups


class OfMechanism:
    """A read-only attribute of the strategy that is its mechanism's attribute of the same name."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, strategy, owner=None):
        return self if strategy is None else getattr(strategy.mechanism, self.name)

    def __set__(self, strategy, value) -> None:
        raise AttributeError(f"{self.name} is the mechanism's: it is fixed when the strategy is constructed (or, "
                             f"for plan and ledger, when training starts); read it as strategy.{self.name}.")


class DPSettings:
    """A strategy's DP settings (see ``DPDeepSpeedStrategy``'s arguments): the clipping and loss settings as
    attributes, σ, C and the random streams in ``self.mechanism``. ``ValueError`` names a bad setting."""

    def __new__(cls, *args, **kwargs):
        # before Lightning's constructor imports DeepSpeed (which logs its accelerator guess then), in the launching
        # process, whose environment the ranks inherit: what every DP run prints and where it builds DeepSpeed's op
        known_warnings.filter_known_log_records()
        known_warnings.filter_known_warnings()
        refusal_report.install()
        default_build_dir()
        return super().__new__(cls)

    def init_dp_settings(self, *, noise_multiplier: Optional[float], max_grad_norm: float, clipping: str,
                         clipping_fn: str, gamma: float, clipping_mode: str, clipping_groups, group_max_grad_norms,
                         poisson_sampling: bool, secure_mode: bool, seed: Optional[int], loss_reduction: str,
                         layout_check: Any, max_micro_batch_size: Optional[int] = None, privacy_unit: str = "example",
                         max_examples_per_user: Optional[int] = None, noise_mechanism: str = "dp-sgd",
                         bands: Optional[int] = None) -> None:
        validate_clipping(clipping, clipping_fn, max_grad_norm, gamma, clipping_mode)
        self.clipping_mode = clipping_mode
        self.loss_reduction = check_option("loss_reduction", loss_reduction, LossReduction)
        check_number("seed", seed, integer=True, optional=True)
        secure_mode, poisson_sampling = check_flag("secure_mode", secure_mode), check_flag("poisson_sampling",
                                                                                            poisson_sampling)
        self.mechanism = DPMechanism(noise_multiplier, max_grad_norm, seed=seed, secure_mode=secure_mode,
                                     poisson_sampling=poisson_sampling, max_micro_batch_size=max_micro_batch_size,
                                     privacy_unit=privacy_unit, max_examples_per_user=max_examples_per_user,
                                     noise_mechanism=noise_mechanism, bands=bands)
        self.clipping, self.clipping_fn, self.gamma = clipping, clipping_fn, gamma
        validate_clipping_groups(clipping, clipping_groups, group_max_grad_norms, max_grad_norm)
        self.clipping_groups, self.group_max_grad_norms = clipping_groups, group_max_grad_norms
        self.layout_check = refusals.layout_check_mode(layout_check)
        self.per_sample: Optional[PerSampleEngine] = None

    def layout_check_due(self) -> bool:
        """Whether the per-example check runs at this micro-batch: at every one, or until the first passed."""
        return self.layout_check == "every-batch" or (self.layout_check == "first-batch"
                                                      and not self.per_sample.layout_verified)

    @property
    def spot_checks(self) -> bool:
        """Whether every micro-batch after the first is spot-checked (``layout_check="every-batch"``)."""
        return self.layout_check == "every-batch"

    def _engine(self, module: nn.Module, groups) -> PerSampleEngine:
        return PerSampleEngine(module, self.mechanism.max_grad_norm, self.clipping, self.clipping_fn, self.gamma,
                               self.loss_reduction, groups=groups, group_max_grad_norms=self.group_max_grad_norms,
                               clipping_mode=self.clipping_mode)

    def check_module(self, module: nn.Module, groups) -> None:
        """Raise what :meth:`attach_engine` would raise about ``module``'s layers (``UnsupportedLayerError``) or
        the clipping groups, leaving the module as it was (attached, then detached): before any process starts."""
        own_forwards = [(m, m.__dict__["forward"]) for m in module.modules() if "forward" in m.__dict__]
        try:
            self._engine(module, groups).attach().detach()
        finally:
            for m, forward in own_forwards:  # (detach removes the engine's; keep any the module had before)
                m.forward = forward

    def attach_engine(self, module: nn.Module, groups, zero_stage: int) -> PerSampleEngine:
        """Build and attach the per-example engine on ``module`` (``groups``: group-wise name patterns, or None),
        hand it to the mechanism, and keep the layers its rules clip whole from ZeRO-3's partitioning."""
        self.per_sample = self._engine(module, groups).attach()
        self.mechanism.attach(self.per_sample, self)
        if zero_stage == 3 and self.per_sample.zero3_leaf_types:
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(module, self.per_sample.zero3_leaf_types)
        return self.per_sample

    def prepare_engine(self, deepspeed_engine) -> None:
        """Once DeepSpeed has initialised, before the first update: two-pass clipping's checks and hooks
        (:meth:`prepare_clipping_mode`), with fp16 the check that DeepSpeed scales the loss it unscales
        (:func:`fp16_loss_scale_check`), and on ZeRO-3 release decisions that follow DeepSpeed's trace
        (:func:`._zero3_trace.keep_release_decisions_fresh`)."""
        self.prepare_clipping_mode(deepspeed_engine)
        fp16 = bool(deepspeed_engine.fp16_enabled())
        # ZeRO 1-3 reduce each gradient in a hook as autograd accumulates it, and the 16-bit optimizers move it to
        # their fp32 copy there: those hooks must fire for every parameter, so deferred sites hand them zeros
        self.per_sample.deferred_zeros = bool(deepspeed_engine.zero_optimization_stage() >= 1
                                              or fp16 or deepspeed_engine.bfloat16_enabled())
        self.mechanism.loss_factor_check = fp16_loss_scale_check(deepspeed_engine)
        self.mechanism.loss_scaled_fp16 = fp16
        self.mechanism.correlated.check_precision(fp16)
        keep_release_decisions_fresh(deepspeed_engine)

    def prepare_clipping_mode(self, deepspeed_engine) -> None:
        """Before the first update, with two-pass clipping: refuse DeepSpeed's fp16 (the norms pass runs without
        its loss scale, so fp16 output gradients could underflow and understate the per-example norms that bound
        each example's contribution), and keep the hooks DeepSpeed's forward puts on its outputs, which
        :meth:`norms_pass` suspends."""
        self._output_hooks: list = []
        self._deepspeed_engine = deepspeed_engine  # ZeRO-3's state after the norms pass (another_backward_follows)
        if self.per_sample is None or not self.per_sample.two_pass:
            return
        if deepspeed_engine.fp16_enabled():
            raise ValueError("clipping_mode='two-pass' does not support fp16 (precision='16-mixed'): its norms pass "
                             "runs without DeepSpeed's loss scale. Use precision='bf16-mixed' or '32-true', or "
                             "clipping_mode='book-keeping'.")

        def keep(module, args, outputs) -> None:
            self._output_hooks = output_hook_managers(outputs)

        deepspeed_engine.register_forward_hook(keep)

    def norms_pass(self, loss) -> None:
        """Two-pass clipping's first backward pass on ``loss`` (a no-op otherwise), unseen by DeepSpeed, whose own
        backward of ``loss`` follows (``PerSampleEngine.norms_pass``)."""
        if self.per_sample.two_pass:
            with output_hooks_suspended(self._output_hooks), another_backward_follows(self._deepspeed_engine):
                self.per_sample.norms_pass(loss)


def fp16_loss_scale_check(deepspeed_engine) -> Optional[Callable[[float], None]]:
    """With DeepSpeed's fp16 (``precision="16-mixed"``), a check of the factor on each loss in backward.

    DeepSpeed's fp16 optimizer divides the gradients by its loss scale S before each update, so the loss must
    reach backward multiplied by S (the factor the loss probe reads, times the accumulation steps, is S).
    DeepSpeed's ``engine.backward`` skips that multiplication at ZeRO stage 0 in some versions (0.19), which would
    make every update S times too small, with DP or without: refused at the first backward where S is not 1,
    before any update. ``None`` without fp16.
    """
    if not deepspeed_engine.fp16_enabled():
        return None
    optimizer = deepspeed_engine.optimizer

    def check(factor: float) -> None:
        scale = float(optimizer.loss_scale)
        if not math.isclose(factor, scale, rel_tol=1e-2):
            import deepspeed

            raise RuntimeError(
                f"DeepSpeed {deepspeed.__version__} did not multiply the loss by its fp16 loss scale ({scale:g}) "
                f"before backward (the factor was {factor:g}), yet its optimizer divides the gradients by that scale "
                f"before each update: every update would be {scale / factor:g} times too small, with DP or without. "
                "DeepSpeed has this bug in its fp16 path at ZeRO stage 0. Use precision='bf16-mixed' or '32-true', or "
                "ZeRO stage 1 or above (e.g. strategy='dp_deepspeed_stage_2').")

    return check
