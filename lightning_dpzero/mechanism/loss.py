"""The loss probe and the stop on a non-finite loss: the part of :class:`~lightning_dpzero.mechanism.DPMechanism` that
reads the factors on the loss (docs/design.md, *The factors on the loss*) and agrees a stop over the ranks."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..util.collectives import sum_over_ranks
from ..sampling.micro_batch import non_finite_loss_message, zero_loss


class NonFiniteLossError(RuntimeError):
    """``training_step`` returned a NaN or infinite loss; training stops with that step charged to the ledger."""


class _LossProbe(torch.autograd.Function):
    """Identity on the loss whose backward reports d(final scaled loss)/d(loss) to the mechanism."""

    @staticmethod
    def forward(ctx, loss, mechanism, accumulate_grad_batches, gradient_accumulation_steps):
        ctx.mechanism, ctx.k, ctx.gas = mechanism, accumulate_grad_batches, gradient_accumulation_steps
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.mechanism._on_loss_grad(g, ctx.k, ctx.gas)
        return g, None, None, None


class LossChecks:
    """:class:`~lightning_dpzero.mechanism.DPMechanism`'s loss probe and non-finite-loss stop (a mixin of it: its
    state is the mechanism's)."""

    def micro_batch_loss(self, loss: Any, batch_size: Optional[int], *, step: Optional[int] = None) -> Any:
        """What :meth:`training_step` does after ``run()``, for a driver whose user computes the loss outside a
        ``training_step`` (a Fabric loop: the engine was told of the micro-batch before its forward): an empty
        Poisson batch's loss (NaN, a mean over no examples) becomes 0, then :meth:`check_finite_loss`."""
        return self.check_finite_loss(zero_loss(loss) if batch_size == 0 else loss, step)

    def check_finite_loss(self, out: Any, step: Optional[int] = None, epoch: Optional[int] = None) -> Any:
        """Stop on a NaN/inf loss (any rank; all ranks agree in one all-reduce), with the step charged.

        A non-finite loss would give NaN per-example norms and coefficients, and a NaN update: never skip it
        silently. The step is charged before raising (conservative: whether the loss was finite depends on the
        batch and is now visible), nothing is applied, and every rank raises the same
        :class:`NonFiniteLossError`. ``step`` and ``epoch`` (the optimizer step being built, the epoch) only
        word the message."""
        if self.plan is None or self.ledger is None:
            return out
        loss = out.get("loss") if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            return out
        world = self.collectives.world_size
        flags = torch.stack([torch.logical_not(torch.isfinite(loss.detach()).all()).to(torch.float32),
                             torch.tensor(float(self._stop_requested), device=loss.device)])
        if world > 1:  # the one collective of every micro-batch: a stop request rides along (see request_stop)
            flags = sum_over_ranks(self.collectives, flags)
        bad, stop = flags.tolist()  # one device-to-host read for both
        self.stop_agreed = self.stop_agreed or stop > 0
        if bad == 0:
            return out
        self.charge()
        raise NonFiniteLossError(non_finite_loss_message(self.ledger, loss, int(bad), world, step, epoch))

    def probe_loss(self, loss: torch.Tensor, accumulate_grad_batches: int = 1,
                   gradient_accumulation_steps: int = 1) -> torch.Tensor:
        """``loss`` through the loss probe, to hand to backward: its backward reads the product ``g`` of every
        factor put on the loss after this point (``1/gradient_accumulation_steps`` and the loss scale of
        DeepSpeed's backward) and has the engine take norms of ``K/g`` times the output gradients, K being
        ``accumulate_grad_batches`` (Lightning's 1/K is on ``loss`` already), and write back ``g·gas`` (the loss
        scale, which DeepSpeed divides out) times the clipped sums (docs/design.md, *The factors on the loss*)."""
        return _LossProbe.apply(loss, self, accumulate_grad_batches, gradient_accumulation_steps)

    def _on_loss_grad(self, g: torch.Tensor, accumulate_grad_batches: int, gradient_accumulation_steps: int) -> None:
        g = float(g)
        if math.isinf(g) and self.loss_scaled_fp16:
            # fp16: the loss times DeepSpeed's loss scale overflowed (an fp16 loss at the default scale 2^16 does).
            # Every gradient emitted is NaN, so DeepSpeed's overflow check skips this step and lowers the scale, as
            # it does without DP; nothing of the batch is released, and the step is charged all the same (I4).
            self.engine.set_loss_factors(grad_scale=math.nan, emit_scale=math.nan)
            return
        if not math.isfinite(g) or g == 0:
            raise RuntimeError(f"The loss gradient is {g}; cannot recover per-example gradients.")
        if self.loss_factor_check is not None:
            self.loss_factor_check(g * gradient_accumulation_steps)
        # undo Lightning's 1/K, DeepSpeed's 1/gas and the loss scale; emit × S, which DeepSpeed divides out
        self.engine.set_loss_factors(grad_scale=accumulate_grad_batches / g,
                                     emit_scale=g * gradient_accumulation_steps)

    def request_stop(self) -> None:
        """Ask the run to stop (from a signal handler: no collective, no lock). Every rank learns it in the
        all-reduce of the next micro-batch's :meth:`check_finite_loss`, at the same point of every rank's program,
        and :attr:`stop_agreed` becomes True there on all ranks alike."""
        self._stop_requested = True
