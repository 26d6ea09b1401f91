"""Lightning's manual optimization (``automatic_optimization = False``: ``self.manual_backward(loss)``,
``opt.step()`` in ``training_step``) as DP steps (docs/design.md, *Manual optimization*).

In manual optimization the user's ``training_step`` calls the backward and the optimizer itself, so nothing
guarantees what automatic optimization does by construction: one backward per Poisson-sampled batch and one
charged step per backward. :class:`ManualSteps` follows the calls of each ``training_step`` (one micro-batch:
Lightning refuses ``accumulate_grad_batches > 1`` in manual optimization) and refuses, before the update is
applied, every pattern whose release the ledger would not account exactly:

* one DP step per batch: ``manual_backward(loss)`` once, then ``opt.step()`` once (``opt.step(closure)`` with the
  backward in the closure too). The step releases ``(Σ_i clip(g_i) + N(0, σ²C²I)) / B_exp`` over exactly that
  batch, charged once: the same step as automatic optimization's;
* a second ``manual_backward`` before the step would clip each example twice (an example could then move the
  update by 2C, while the noise is calibrated to C): refused, with the fix (sum the losses, one backward);
* a step without a backward since the last one, or a second step on the batch, would release the batch twice (or
  a step on no batch), which a charge of (q, σ) per step does not account: refused;
* a backward whose step does not come in the same ``training_step`` would carry its clipped sums into the next
  batch's step (two Poisson draws in one update): refused at the end of the ``training_step``;
* a ``training_step`` with neither backward nor step releases nothing and charges nothing.

The layout check re-runs ``training_step`` (twice, without gradients, at the first micro-batch): inside it the
calls are made inert (:meth:`ManualSteps.inert`), and Lightning's optimizer-step counters and the learning-rate
schedulers do not advance.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

from ..deepspeed.zero3_trace import outside_engine_forward

_LOOP = ("A DP training_step in manual optimization is: compute the loss of the batch, self.manual_backward(loss) "
         "once, opt.step() once (opt.zero_grad() before the backward or after the step); each such step is one "
         "Poisson-sampled batch, clipped per example and charged to the privacy ledger once.")


def manual_optimization_refusal(trainer) -> Optional[str]:
    """What is still refused of a Trainer's manual optimization before training (``None``: nothing); the calls
    inside ``training_step`` are checked as they come (:class:`ManualSteps`), and a second optimizer when
    ``configure_optimizers`` runs (:func:`several_optimizers_message`)."""
    if trainer.accumulate_grad_batches != 1:
        return (f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) with automatic_optimization="
                "False: Lightning does not accumulate in manual optimization, and a DP step must release one "
                "Poisson-sampled batch. Use accumulate_grad_batches=1 and a larger DataLoader batch_size.")
    return None


def one_optimizer(init_optimizers: Callable[[], Any]) -> Any:
    """``init_optimizers()`` (Lightning's DeepSpeed strategy's, which takes one optimizer); its refusal of several
    says what a DP run with several can do instead."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    try:
        return init_optimizers()
    except MisconfigurationException as e:
        if "single optimizer" not in str(e):
            raise
        raise MisconfigurationException(f"{e} {_SEVERAL}") from e


_SEVERAL = ("With DP: the DeepSpeed optimizer is the private one (each step a clipped, noised, charged "
            "step); a second model trained only on what the private one releases (a DP-GAN's generator) is "
            "post-processing and needs an optimizer of its own, which a Fabric loop gives it: "
            "fabric.setup(post_processing(generator), generator_optimizer) beside fabric.setup(discriminator, "
            "optimizer) (docs/how-to/dp-gan.md).")


class ManualSteps:
    """The calls of the current ``training_step``: backwards and DP steps since it started (see the module).
    ``enabled=False`` (automatic optimization): every method lets everything through unchanged."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.backwards = self.steps = 0
        self.batch_size: Optional[int] = None
        self._inert = False

    @property
    def is_inert(self) -> bool:
        """Inside the layout check's re-runs: backward and step do nothing."""
        return self._inert

    def start(self, batch_size: Optional[int]) -> None:
        """A ``training_step`` on a micro-batch of ``batch_size`` examples starts."""
        if not self.enabled:
            return
        self.backwards = self.steps = 0
        self.batch_size = batch_size

    def before_backward(self) -> None:
        """``manual_backward`` is about to run: the first since the step (if any) of this batch."""
        if self.steps:
            raise RuntimeError("self.manual_backward after opt.step() in the same training_step: a second DP step "
                               "on one Poisson-sampled batch would release it twice, which the privacy ledger "
                               f"does not account. Nothing of it was applied. {_LOOP}")
        if self.backwards:
            raise RuntimeError("self.manual_backward called twice before opt.step(): each backward clips every "
                               "example to max_grad_norm, so together an example could move the update by twice "
                               "that, while the noise is calibrated to once. Sum the losses and call "
                               f"self.manual_backward once. Nothing of this step was applied. {_LOOP}")
        self.backwards += 1

    def before_update(self) -> None:
        """``opt.step()``'s closure has run (the backward may be in it); the update is about to be applied."""
        if self.steps:
            raise RuntimeError("opt.step() called twice in one training_step: each DP step must train on its own "
                               "Poisson-sampled batch (a second step on the same batch is not what the privacy "
                               f"ledger charges). Nothing of the second step was applied. {_LOOP}")
        if not self.backwards:
            raise RuntimeError("opt.step() without self.manual_backward(loss) on this training_step's batch: a DP "
                               "step releases the clipped gradients of the batch drawn for it. Nothing of the step "
                               f"was applied. {_LOOP}")
        self.steps += 1

    def end(self) -> None:
        """The ``training_step`` returned: a backward must have been stepped."""
        if self.enabled and self.backwards and not self.steps:
            self.backwards = 0
            raise RuntimeError("self.manual_backward without opt.step() in the same training_step: its clipped "
                               "gradients would be added to the next batch's step (two Poisson draws in one "
                               "update, not what the privacy ledger charges; accumulating over batches is not "
                               "supported in manual optimization). Nothing of it was applied. Call opt.step() in "
                               f"the training_step of the backward. {_LOOP}")

    def backward_loss(self, strategy, loss):
        """The loss ``manual_backward`` hands on (after :meth:`before_backward`): an empty batch's as 0, a
        non-finite one stops training with the step charged (``DPMechanism.micro_batch_loss``); ``None`` inside
        the layout check's re-runs (no backward then). Automatic optimization: ``loss`` as it is."""
        if not self.enabled:
            return loss
        if self._inert:
            return None
        self.before_backward()
        step = strategy.lightning_module.trainer.global_step + 1
        return strategy.mechanism.micro_batch_loss(loss, self.batch_size, step=step)

    def backward_context(self, deepspeed_engine) -> contextlib.AbstractContextManager:
        """Around the backward: in manual optimization it runs inside the engine's forward, whose ZeRO-3 marks are
        lifted for it (:func:`._zero3_trace.outside_engine_forward`)."""
        return outside_engine_forward(deepspeed_engine) if self.enabled else contextlib.nullcontext()

    def checked(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``opt.step()``'s closure, then :meth:`before_update` (before the charge and the update)."""
        if not self.enabled:
            return closure

        def run() -> Any:
            out = closure()
            self.before_update()
            return out
        return run

    @contextlib.contextmanager
    def inert(self, trainer) -> Iterator[None]:
        """For the layout check's re-runs of ``training_step``: backward and step do nothing (the strategy asks
        :attr:`is_inert`), and neither Lightning's optimizer-step progress nor the learning-rate schedulers
        advance."""
        if not self.enabled:
            yield
            return
        saved_backwards, saved_steps = self.backwards, self.steps
        optimizers = list(trainer.strategy._lightning_optimizers)
        hooks = [(o, o._on_before_step, o._on_after_step) for o in optimizers]
        schedulers = [(c.scheduler, vars(c.scheduler).get("step")) for c in trainer.lr_scheduler_configs]
        self._inert = True
        try:
            for o in optimizers:
                o._on_before_step = o._on_after_step = _nothing
            for s, _ in schedulers:
                s.step = _nothing  # an instance attribute shadows the method
            yield
        finally:
            self._inert = False
            self.backwards, self.steps = saved_backwards, saved_steps
            for o, before, after in hooks:
                o._on_before_step, o._on_after_step = before, after
            for s, own in schedulers:
                vars(s).pop("step", None)
                if own is not None:
                    s.step = own


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None
