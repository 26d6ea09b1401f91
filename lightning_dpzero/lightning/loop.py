"""Where Lightning's training loop meets the DP step: accumulation windows, step counters and SIGTERM.

**Accumulation windows.** One optimizer step must release exactly one logical batch: one Poisson draw, whose K
micro-batches the DP sampler yields consecutively (K = ``accumulate_grad_batches``). With DeepSpeed, Lightning
calls the optimizer step on every micro-batch and counts an update when its per-epoch micro-batch counter is a
multiple of K, while DeepSpeed decides from its own counter, which runs on across epochs and restarts with each
process. The strategy therefore sets DeepSpeed's boundary explicitly before every micro-batch from Lightning's
position in the epoch (the sampler restarts every epoch at a window start), refuses an epoch length that is not a
multiple of K (``_refusals.check_whole_windows``) and a fit that starts inside a window (a resume position), and
the mechanism checks at every update that the ledger, Lightning's ``global_step`` and DeepSpeed's
``global_steps`` advanced alike (:class:`~lightning_dpzero.accounting.step_counts.StepCounts`).

**SIGTERM.** Lightning's SIGTERM notifier runs a ``torch.distributed.broadcast`` inside the signal handler, i.e.
at an arbitrary point of each rank's program, where it can pair with any other collective and deadlock (what a
cluster's preemption, SIGTERM to every process, does). For a DP fit the notifier is replaced by one that only
sets a flag; the flag rides in the all-reduce the mechanism already runs every micro-batch, so every rank learns
it after the same micro-batch, and ``trainer.received_sigterm`` is set on all ranks together at the end of that
accumulation window: Lightning then stops every rank after the same optimizer step (saving a checkpoint if a
callback such as ``OnExceptionCheckpoint`` does), and no window is cut (docs/reliability.md).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info

from ..sampling.collate import stand_in_batch
from ..sampling.micro_batch import random_state_kept
from .refusals import check_one_training_loader

log = logging.getLogger(__name__)


def micro_batch_index(trainer) -> int:
    """0-based index, in its epoch, of the micro-batch being run (Lightning counts it ready before its hooks)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1


def closes_window(trainer) -> bool:
    """Whether the micro-batch being run is the last of its accumulation window (Lightning then counts an update)."""
    return (micro_batch_index(trainer) + 1) % trainer.accumulate_grad_batches == 0


def check_window_start(trainer) -> None:
    """At the first micro-batch of a fit: refuse to start inside an accumulation window.

    A checkpoint saved mid-window (e.g. on an exception) and resumed, or resumed with another
    ``accumulate_grad_batches``, restores Lightning's position in the epoch while the sampler restarts the epoch
    at a window start: every later update would hold micro-batches of two Poisson draws.

    Raises:
        ValueError: the position is not a multiple of ``accumulate_grad_batches``.
    """
    index, k = micro_batch_index(trainer), trainer.accumulate_grad_batches
    if index % k:
        raise ValueError(
            f"This fit starts at micro-batch {index} of epoch {trainer.current_epoch} (the position restored from the "
            f"checkpoint), inside an accumulation window of accumulate_grad_batches={k}: each optimizer step must "
            "release exactly one Poisson-sampled logical batch, whose micro-batches the DP sampler yields together, "
            "and from here every step would mix two. Nothing was trained. Resume from a checkpoint saved at an "
            "optimizer-step boundary (ModelCheckpoint(every_n_train_steps=...) or an epoch end), or with an "
            f"accumulate_grad_batches that divides {index}, e.g. accumulate_grad_batches=1.")


def prepared_stand_in(strategy) -> Any:
    """An empty micro-batch's one-row stand-in (``_collate.stand_in_batch``) from the strategy's private loader,
    prepared as Lightning's loop prepares a batch: the precision's input conversion, ``on_before_batch_transfer``,
    the transfer; ``None`` where there is none."""
    batch = stand_in_batch(strategy._private_loader)
    if batch is None:
        return None
    module = strategy.lightning_module
    batch = module.trainer.precision_plugin.convert_input(batch)
    batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
    return strategy.batch_to_device(batch, dataloader_idx=0)


def empty_batch_step(strategy, args: tuple, step) -> Any:
    """An empty micro-batch's ``step(args, rows)`` on its one-row stand-in (:func:`prepared_stand_in`; on its zero
    rows where there is none), built and run with the random streams restored afterwards: a later step's dropout
    mask must not depend on the stand-in's shape."""
    with random_state_kept(strategy.root_device):
        stand_in = prepared_stand_in(strategy)
        if stand_in is None:
            return step(args, 0)
        return step((stand_in, *args[1:]), extract_batch_size(stand_in))


def step_counters(trainer, deepspeed_engine, with_this_update: bool = False) -> dict[str, int]:
    """Lightning's and DeepSpeed's update counters. ``with_this_update`` (inside DeepSpeed's boundary step, before
    the update): each counting the update being built if it will (Lightning counts it when its loop does not
    accumulate this micro-batch; DeepSpeed steps at its boundary)."""
    lightning_counts = with_this_update and not trainer.fit_loop._should_accumulate()
    return {"Lightning global_step": trainer.global_step + int(lightning_counts),
            "DeepSpeed global_steps": int(deepspeed_engine.global_steps) + int(with_this_update)}


def resume_advice(trainer) -> str:
    """What a fit stopped by SIGTERM resumes from, as a sentence: the checkpoint ``OnExceptionCheckpoint`` writes at
    the stop; else the newest checkpoint a ``ModelCheckpoint`` wrote (the steps after it are lost, and charged
    again when redone); else how to have one written."""
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    callbacks = getattr(trainer, "callbacks", [])
    on_exception = next((cb for cb in callbacks if isinstance(cb, OnExceptionCheckpoint)), None)
    if on_exception is not None:
        path = on_exception.ckpt_path
        return f"OnExceptionCheckpoint saves {path}: resume with trainer.fit(model, ckpt_path=\"{path}\")."
    saved = [Path(p) for cb in callbacks if isinstance(cb, ModelCheckpoint)
             for p in (cb.last_model_path, cb.best_model_path) if p and Path(p).exists()]
    if saved:
        path = max(saved, key=lambda p: p.stat().st_mtime)
        return (f"No checkpoint is saved at the stop; the newest is {path} (the steps after it are not in it, and "
                f"are charged again when redone): resume with trainer.fit(model, ckpt_path=\"{path}\"), and add "
                "lightning.pytorch.callbacks.OnExceptionCheckpoint(dirpath=...) to save one at the stop.")
    return ("No checkpoint is saved at the stop, and none was saved before: add "
            "lightning.pytorch.callbacks.OnExceptionCheckpoint(dirpath=...) to the callbacks to save one there, and "
            "resume from it with trainer.fit(model, ckpt_path=...).")


class FitLoopGuard:
    """What :class:`~lightning_dpzero.DPDeepSpeedStrategy` does around Lightning's loop for ``mechanism``: the
    accumulation window of every micro-batch, the step counters, and the SIGTERM notifier.

    :meth:`install` (at setup, before Lightning registers its signal handlers, which pick the notifier up from
    the connector) replaces Lightning's SIGTERM notifier by one that only asks the mechanism to stop;
    :meth:`uninstall` (teardown) gives Lightning its own back. Lightning's handler composition is kept: the
    SLURM requeue bypass and a handler the user had installed still run, and a launcher that started the other
    processes still forwards the signal to them.
    """

    def __init__(self, mechanism) -> None:
        self.mechanism = mechanism
        self.trainer: Optional[Any] = None
        self._connector: Optional[Any] = None
        self._first = True
        self._loaders_checked: Optional[Any] = None  # the CombinedLoader checked to hold one training loader

    def install(self, trainer) -> None:
        self.trainer, self._first = trainer, True
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and hasattr(connector, "_sigterm_notifier_fn"):
            connector._sigterm_notifier_fn = self._notify  # an instance attribute shadows Lightning's method
            self._connector = connector

    def uninstall(self) -> None:
        if self._connector is not None:
            vars(self._connector).pop("_sigterm_notifier_fn", None)
            self._connector = None

    def _notify(self, signum, frame) -> None:
        # runs at an arbitrary point of this rank's program: no collective, no lock
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        if not self.mechanism._stop_requested:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        self.mechanism.request_stop()

    def before_micro_batch(self, deepspeed_engine) -> None:
        """Before a micro-batch's forward. At the fit's first (and after a reload of the training loaders): refuse
        several training loaders (``_refusals.check_one_training_loader``); at the fit's first: refuse a start
        inside a window and take the step counters' baseline. Then set DeepSpeed's accumulation boundary to the
        end of the window, so DeepSpeed reduces and steps exactly when Lightning counts an update."""
        trainer = self.trainer
        combined = trainer.fit_loop._combined_loader  # a new one after a reload of train_dataloader()
        if combined is not self._loaders_checked:
            check_one_training_loader(combined)
            self._loaders_checked = combined
        if self._first:
            check_window_start(trainer)
            self.mechanism.begin_fit(step_counters(trainer, deepspeed_engine))
            self._first = False
        deepspeed_engine.set_gradient_accumulation_boundary(closes_window(trainer))

    def after_micro_batch(self) -> None:
        """After a micro-batch's forward (whose all-reduce carried the stop flag): at the end of the window, tell
        Lightning, on every rank alike, so that it stops after this optimizer step."""
        if self._connector is None or not self.mechanism.stop_agreed or not closes_window(self.trainer):
            return
        if not self._connector.received_sigterm:
            rank_zero_info("SIGTERM received: every rank stops after this optimizer step (the privacy ledger "
                           "charges it). " + resume_advice(self.trainer))
        self._connector.received_sigterm = True
