"""A micro-batch's loss as the DP step sees it: an empty Poisson batch's loss and logging, and the message of a
non-finite loss (docs/design.md, *Where each piece runs*: forward)."""

from __future__ import annotations

import contextlib
import random
from typing import Any, Optional

import numpy as np
import torch

from .collate import empty_like


@contextlib.contextmanager
def logging_suppressed(module):
    """``module.log``/``log_dict`` (a LightningModule's) do nothing inside the block; ``None``: nothing changes."""
    if module is None:
        yield
        return
    module.log = module.log_dict = lambda *args, **kwargs: None  # instance attributes shadow the methods
    try:
        yield
    finally:
        del module.log, module.log_dict


@contextlib.contextmanager
def random_state_kept(device: torch.device):
    """The random streams (Python's, NumPy's, torch's on the CPU and on ``device``) are as they were after the
    block: an empty micro-batch's stand-in, built and run forward inside it, draws nothing a later step sees
    (dropout masks would otherwise depend on the stand-in's shape)."""
    states = random.getstate(), np.random.get_state()
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(states[0])
    np.random.set_state(states[1])


def without_rows(out: Any) -> Any:
    """A stand-in's ``training_step`` output for the hooks after it: every tensor with rows sliced to none (as an
    empty batch's would be), lists of plain values emptied; the loss and other scalars kept."""
    if isinstance(out, dict):
        return {k: v if k == "loss" else empty_like(v) for k, v in out.items()}
    return empty_like(out)


def zero_loss(out):
    """The loss of an empty Poisson batch (NaN: a mean over no examples; a stand-in's: any value) as 0, in a tensor
    or a ``{'loss': ...}``."""
    def zero(loss: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0

    if isinstance(out, torch.Tensor):
        return zero(out) if out.numel() == 1 else out
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return {**out, "loss": zero(out["loss"])}
    return out


def non_finite_loss_message(ledger, loss: torch.Tensor, bad: int, world: int, step: Optional[int],
                            epoch: Optional[int]) -> str:
    """What :class:`~lightning_dpzero.mechanism.NonFiniteLossError` says: where, on how many of the ranks, that the
    step was charged (with the ledger's ε), and the usual causes and fix."""
    try:
        eps = f"ε = {ledger.epsilon():.6g} at δ = {ledger.delta:g}"
    except Exception:  # noqa: BLE001 - the error matters more than the number
        eps = "ε unavailable"
    local = float(loss.detach().float().flatten()[0]) if loss.numel() else float("nan")
    return (f"training_step returned a non-finite loss at optimizer step {step} (epoch {epoch}; this rank's loss: "
            f"{local}) on {bad} of {world} rank(s). Training stopped before the update; DP training "
            f"never skips such a step silently. The step was charged to the privacy ledger ({ledger.steps} "
            f"steps, {eps}). Fix the cause (a loss that overflows, e.g. log of 0 or exp of large logits: compute it "
            "from logits, as cross_entropy does; too large a learning rate; bad values in the data), then resume "
            "from the last checkpoint.")
