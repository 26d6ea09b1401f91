"""Refusals found before any process starts (docs/design.md, *Where each piece runs*: launch).

``trainer.fit`` hands its work to the strategy's launcher, which starts the other ranks and then DeepSpeed: a
refusal found in ``setup`` came after 45-55 s of start-up, once per rank. What needs no process group is checked
here, in the launching process, before the launcher runs: the Trainer's and DeepSpeed's settings
(:func:`~lightning_dpzero.lightning.refusals.check_trainer`), the model's layers as they are now (the per-example engine
attached and detached again), and for a training ``DataLoader`` passed to ``fit`` its sampler, q and the privacy
plan (σ against the target ε over the planned steps). Every check is the one the ranks run again later, with the
numbers the ranks will have (W = nodes × devices, the global dataset), so the verdict is theirs; what depends on
the ranks is left to them: per-rank shards, a resumed ledger, a loader from a ``LightningDataModule`` or
``train_dataloader()``, layers that ``configure_model`` or ``setup`` builds, the clipping groups.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from . import refusals


class _LaunchingRanks:
    """The ranks as the launching process knows them before any process group: W, this process rank 0."""

    global_rank = 0

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj


def check_before_launch(strategy) -> None:
    """Wrap ``strategy.launcher.launch`` so that a fit is checked (:func:`check_fit`) before it starts anything."""
    launcher = getattr(strategy, "_launcher", None)
    if launcher is None:
        return
    launch = launcher.launch

    def checked_launch(function, *args: Any, trainer=None, **kwargs: Any) -> Any:
        from lightning.pytorch.trainer.states import TrainerFn

        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and args:
            check_fit(strategy, trainer, args[0], args[1] if len(args) > 1 else None)
        return launch(function, *args, trainer=trainer, **kwargs)

    launcher.launch = checked_launch


def check_fit(strategy, trainer, model, train_dataloaders) -> None:
    """Raise what the ranks would raise about these settings, model and loader, before the first update.

    Raises:
        ValueError, TypeError, UnsupportedLayerError: as :meth:`DPDeepSpeedStrategy.setup` and its loader would.
    """
    with warnings.catch_warnings():  # the ranks warn (once, rank 0): nothing is said twice
        warnings.simplefilter("ignore")
        refusals.check_trainer(trainer, strategy.config)
        # the layers only: clipping groups are formed on the ranks (their patterns may name layers that
        # configure_model or setup builds there, absent here)
        strategy.check_module(model, None)
        if isinstance(train_dataloaders, DataLoader) and _global_and_sized(train_dataloaders, trainer):
            _check_loader_and_plan(strategy, trainer, train_dataloaders)


def _global_and_sized(dataloader: DataLoader, trainer) -> bool:
    """A loader whose checks the launching process can run as the ranks will: one global dataset (Lightning's
    sampler injection on; shards per rank are only known on the ranks) with a length, and not the explicit
    ``BatchSampler`` that Lightning's injection turns into batches of 1 before the ranks see it."""
    dataset = dataloader.dataset
    if not trainer._accelerator_connector.use_distributed_sampler or isinstance(dataset, IterableDataset):
        return False
    try:
        len(dataset)
    except TypeError:
        return False
    return not (type(dataloader.batch_sampler) is BatchSampler and dataloader.batch_size is None)


def _check_loader_and_plan(strategy, trainer, dataloader: DataLoader) -> None:
    from .callback import PrivacyAccountantCallback
    from ..accounting.plan import PrivacyPlan
    from ..sampling.shards import private_training_loader

    mechanism = strategy.mechanism
    k = trainer.accumulate_grad_batches
    world = strategy.num_nodes * strategy.num_processes
    loader = private_training_loader(dataloader, _LaunchingRanks(world), k, pre_sharded=False,
                                     poisson=mechanism.poisson_sampling, seed=0, secure_mode=False,
                                     max_micro_batch_size=mechanism.max_micro_batch_size)
    per_epoch = refusals.micro_batches_per_epoch(dataloader, loader, trainer)
    callbacks = [c for c in trainer.callbacks if isinstance(c, PrivacyAccountantCallback)]
    settings = callbacks[0].settings if callbacks else mechanism.accounting
    if mechanism.noise_multiplier is None and settings.target_epsilon is not None:
        return  # σ is calibrated on the ranks (seconds of accounting; it fits any bounded run)
    PrivacyPlan.for_sampler(loader.batch_sampler, settings, noise_multiplier=mechanism.noise_multiplier,
                            max_micro_batch_size=mechanism.max_micro_batch_size, accumulate_grad_batches=k,
                            micro_batches_per_epoch=per_epoch, max_steps=trainer.max_steps,
                            max_epochs=trainer.max_epochs)
