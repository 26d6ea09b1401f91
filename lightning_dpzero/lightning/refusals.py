"""What :class:`~lightning_dpzero.DPDeepSpeedStrategy` refuses or explains about Lightning and DeepSpeed settings.

Each check raises before the first update with a message naming the setting and the fix (docs/design.md,
*Where each piece runs*: setup), or turns a bare error of Lightning or DeepSpeed into one that says what
happened in DP terms.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch.utils.data import DistributedSampler
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .manual_loop import manual_optimization_refusal
from ..accounting.plan import limited_micro_batches


def check_trainer(trainer, deepspeed_config) -> None:
    """Refuse Trainer and DeepSpeed settings that would clip the noisy gradient or under-charge the ledger."""
    if trainer.gradient_clip_val:
        raise ValueError(
            f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) would clip the *noisy* batch gradient; "
            "DP training clips each example instead. Remove gradient_clip_val and set the strategy's "
            "max_grad_norm.")
    if not trainer.lightning_module.automatic_optimization:  # what of manual optimization is still refused
        refusal = manual_optimization_refusal(trainer)
        if refusal:
            raise ValueError(refusal)
    if deepspeed_config and deepspeed_config.get("gradient_clipping"):
        raise ValueError(
            f"The DeepSpeed config sets gradient_clipping={deepspeed_config['gradient_clipping']}; per-example "
            "clipping replaces it. Remove it from the config and set the strategy's max_grad_norm.")


def check_precision(precision, accelerator, deepspeed_config) -> None:
    """Refuse fp16 (``precision="16-mixed"``/``"16-true"``, or ``fp16.enabled`` in the DeepSpeed config) on a CPU
    accelerator, when the Trainer or Fabric is built, where DeepSpeed's CPU accelerator has no fp16 (it has where
    oneDNN has fp16 kernels for the CPU): DeepSpeed stopped such a run after start-up with a bare ``Type fp16 is
    not supported on your device``."""
    from lightning.fabric.accelerators import CPUAccelerator as FabricCPU
    from lightning.pytorch.accelerators import CPUAccelerator

    if not isinstance(accelerator, (CPUAccelerator, FabricCPU)):
        return
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():  # the same test DeepSpeed's engine makes
        return
    fp16 = (deepspeed_config or {}).get("fp16", {}).get("enabled", False)
    if str(precision) in ("16-mixed", "16-true", "16") or fp16:
        setting = f"precision={str(precision)!r}" if not fp16 else "the DeepSpeed config's fp16.enabled"
        raise ValueError(
            f"{setting} asks for fp16, which DeepSpeed's CPU accelerator does not support (it would stop after "
            "start-up with 'Type fp16 is not supported on your device'). On the CPU use precision='bf16-mixed' "
            "(or '32-true'); fp16 works on CUDA.")


def base_optimizer(deepspeed_engine) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` DeepSpeed's wrappers step last, with this rank's fp32 partition."""
    base = deepspeed_engine.optimizer
    while hasattr(base, "optimizer") and not isinstance(base, torch.optim.Optimizer):
        base = base.optimizer
    if not isinstance(base, torch.optim.Optimizer):
        raise TypeError(f"DP noise needs a torch.optim.Optimizer under DeepSpeed, found {type(base).__name__}; "
                        "define the optimizer in configure_optimizers, not in the DeepSpeed config.")
    return base


def warn_injected_batch_size_one(dataloader) -> None:
    """Lightning's DistributedSampler injection turns ``batch_sampler=BatchSampler(...)`` into batches of 1."""
    if getattr(dataloader, "batch_size", None) == 1 and isinstance(getattr(dataloader, "sampler", None),
                                                                   DistributedSampler):
        rank_zero_warn(
            "The training DataLoader has batch_size=1 after Lightning's DistributedSampler injection, so the "
            "sample rate q is set for micro-batches of 1 example. If you built it with batch_sampler="
            "BatchSampler(...), Lightning dropped that batch sampler: pass batch_size=B instead (the DP sampler "
            "replaces the sampling anyway), or set Trainer(use_distributed_sampler=False) to have it refused.")


def layout_check_mode(layout_check) -> str:
    """``layout_check`` as one of ``LayoutCheck`` (``True``: ``"every-batch"``, ``False``: ``"off"``); ``"off"``
    warns what is then no longer proven. Raises ``ValueError`` for another value."""
    from ..util.options import LayoutCheck, check_option

    mode = (("every-batch" if layout_check else "off") if isinstance(layout_check, bool)
            else check_option("layout_check", layout_check, LayoutCheck))
    if mode == "off":
        rank_zero_warn(
            f"layout_check={layout_check!r}: the strategy does not prove that every layer's input is batch first "
            "and per example, nor that the loss is per example. A time-first activation (T, B, d) with T == B, an "
            "input shared by every example (T5's relative attention bias with L == B), a statistic over the "
            "batch or a loss averaged over the batch's tokens would then train with wrong per-example gradients "
            "and release non-private updates without an error.")
    return mode


def micro_batches_per_epoch(dataloader, loader, trainer) -> int:
    """Micro-batches an epoch of the private ``loader`` runs (built from the user's ``dataloader``), after the
    warnings and refusals about them: Lightning's batch-size-one injection, an epoch of cut windows."""
    warn_injected_batch_size_one(dataloader)
    per_epoch = limited_micro_batches(len(loader), trainer.limit_train_batches)
    check_whole_windows(per_epoch, trainer.accumulate_grad_batches, trainer.limit_train_batches)
    return per_epoch


def check_one_training_loader(combined_loader) -> None:
    """Refuse a fit on several training DataLoaders (``train_dataloader`` returning a dict, a list or a
    ``CombinedLoader`` of them), before its first update.

    The DP strategy makes each of them private on its own, with its own N and q, while the plan and the ledger
    charge only one (the last set up): a ``training_step`` that trains on another's batches would train on
    examples drawn above the charged q, from a dataset N does not count, and one update would hold two draws.

    Raises:
        ValueError: naming the loaders and the fix (one dataset: ``ConcatDataset``).
    """
    loaders = combined_loader.flattened if combined_loader is not None else []
    if len(loaders) <= 1:
        return
    iterables = combined_loader.iterables
    names = (f"the keys {', '.join(map(repr, iterables))}" if isinstance(iterables, dict)
             else f"a {type(iterables).__name__} of {len(loaders)}")
    raise ValueError(
        f"train_dataloader() gave {len(loaders)} training DataLoaders ({names}), but a DP fit samples one training "
        "set: each loader would be sampled with its own N and q while the privacy ledger charges only one of them, "
        "so a training_step using another's batches would train on examples drawn above the q charged. Put the "
        "examples in one dataset, e.g. DataLoader(ConcatDataset([first.dataset, second.dataset]), batch_size=B), "
        "so that N counts every example and each is sampled at the one q the ledger charges. Nothing was trained.")


def check_whole_windows(micro_batches: int, accumulate_grad_batches: int, limit_train_batches) -> None:
    """Refuse an epoch whose micro-batches are not whole accumulation windows (``Trainer(limit_train_batches=...)``).

    Each optimizer step releases one Poisson-sampled logical batch, whose K micro-batches the DP sampler yields
    consecutively. An epoch cut inside a window would carry part of a draw into the next epoch's first update
    (one example could then be in one update twice) or leave a partial draw, whose first chunks depend on the
    other examples of the draw: either can change an update by more than C when one example is added.
    """
    k = accumulate_grad_batches
    if k <= 1 or micro_batches % k == 0:
        return
    below, above = micro_batches - micro_batches % k, micro_batches - micro_batches % k + k
    fix = " or ".join(str(n) for n in (below, above) if n > 0)
    raise ValueError(
        f"Trainer(limit_train_batches={limit_train_batches!r}) runs {micro_batches} micro-batches per epoch, which "
        f"is not a multiple of accumulate_grad_batches={k}: an optimizer step would then mix micro-batches of two "
        "Poisson draws (or release part of one), which the privacy accounting does not cover. Use "
        f"limit_train_batches={fix}, a multiple of accumulate_grad_batches={k}.")


@contextlib.contextmanager
def explain_released_parameters(zero_stage: int):
    """ZeRO-3 gathers a parameter only inside the forward of the module that owns it; used elsewhere (in
    training_step) it is an empty partition and PyTorch reports a bare size mismatch against 0."""
    try:
        yield
    except RuntimeError as e:
        msg = str(e)
        if zero_stage != 3 or not re.search(r"(size|shape)[^\n]*\b0\b", msg):
            raise
        raise RuntimeError(
            f"{msg}\n\nUnder ZeRO-3 (DeepSpeed stage 3) a parameter holds data only inside the forward of the "
            "module that owns it; if training_step (outside any forward) uses a parameter, e.g. a learned "
            "temperature self.log_t.exp(), that parameter is an empty partition there. Use it inside a "
            "module's forward instead (a parameter used outside its layer is refused by the DP engine anyway, "
            "since its gradient would not be clipped per example).") from e


def explain_missing_len(exception: BaseException, training: bool) -> None:
    """Lightning injects its DistributedSampler into the training loader before the strategy replaces it, so a
    dataset without ``__len__`` fails there with Python's bare "has no len()": name the setting and the fix."""
    tb, frames = exception.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    if training and isinstance(exception, TypeError) and "_get_distributed_sampler" in frames:
        from lightning.pytorch.utilities.exceptions import _augment_message

        _augment_message(exception, ".*has no len\\(\\).*", (
            f"{exception} - DP accounting needs the training set's size N: give the training dataset a __len__ "
            "(a map-style Dataset with __len__ and __getitem__); Poisson sampling and the accountant both need "
            "N."))
