"""What the Trainer's and Fabric's DP strategies share: their DP settings, checked once when constructed, and the
per-example engine they attach before DeepSpeed wraps the model (docs/design.md, *Where each piece runs*)."""

from __future__ import annotations

from typing import Optional

from torch import nn

from . import _refusals
from ._options import LossReduction, check_option
from .mechanism import DPMechanism
from .per_sample import PerSampleEngine
from .per_sample.clipping import validate_clipping, validate_clipping_groups


class DPSettings:
    """A strategy's DP settings (see ``DPDeepSpeedStrategy``'s arguments): the clipping and loss settings as
    attributes, σ, C and the random streams in ``self.mechanism``. ``ValueError`` names a bad setting."""

    def init_dp_settings(self, *, noise_multiplier: Optional[float], max_grad_norm: float, clipping: str,
                         clipping_fn: str, gamma: float, clipping_groups, group_max_grad_norms,
                         poisson_sampling: bool, secure_mode: bool, seed: Optional[int], loss_reduction: str,
                         layout_check: bool, max_micro_batch_size: Optional[int] = None) -> None:
        validate_clipping(clipping, clipping_fn, max_grad_norm, gamma)
        self.loss_reduction = check_option("loss_reduction", loss_reduction, LossReduction)
        self.mechanism = DPMechanism(noise_multiplier, max_grad_norm, seed=seed, secure_mode=secure_mode,
                                     poisson_sampling=poisson_sampling, max_micro_batch_size=max_micro_batch_size)
        self.clipping, self.clipping_fn, self.gamma = clipping, clipping_fn, gamma
        validate_clipping_groups(clipping, clipping_groups, group_max_grad_norms, max_grad_norm)
        self.clipping_groups, self.group_max_grad_norms = clipping_groups, group_max_grad_norms
        self.layout_check = _refusals.warn_layout_check_off(layout_check)
        self.per_sample: Optional[PerSampleEngine] = None

    def attach_engine(self, module: nn.Module, groups, zero_stage: int) -> PerSampleEngine:
        """Build and attach the per-example engine on ``module`` (``groups``: group-wise name patterns, or None),
        hand it to the mechanism, and keep the layers its rules clip whole from ZeRO-3's partitioning."""
        self.per_sample = PerSampleEngine(module, self.mechanism.max_grad_norm, self.clipping, self.clipping_fn,
                                          self.gamma, self.loss_reduction, groups=groups,
                                          group_max_grad_norms=self.group_max_grad_norms).attach()
        self.mechanism.attach(self.per_sample, self)
        if zero_stage == 3 and self.per_sample.zero3_leaf_types:
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(module, self.per_sample.zero3_leaf_types)
        return self.per_sample
