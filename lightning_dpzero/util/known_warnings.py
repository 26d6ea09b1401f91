"""Warnings and log lines a DP run would print that its user cannot act on, filtered when a strategy is built or
sets up.

Only warnings raised inside the libraries by calls the libraries make themselves, matched by category and exact
message (and by the module they are attributed to where that names the caller), and log records matched by the
logger that emits them and the start of their message. Nothing the user's own code or settings cause is filtered:
warnings about the user's module, data loaders, loggers or Trainer settings still show.
"""

from __future__ import annotations

import logging
import warnings

#: (category, message regex, module regex, why). DeepSpeed's ZeRO collectives call torch.distributed's
#: deprecated names every step; torch attributes the warning to its own wrapper (``c10d_logger``) whoever
#: calls it, and Lightning and DeepSpeed reset the "once per location" registry by changing the filters, so a run
#: printed it hundreds of times. Lightning's own ``_pytree`` uses a deprecated torch API.
KNOWN_WARNINGS = (
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated\.",
     r"torch\.distributed\.c10d_logger", "DeepSpeed's ZeRO collectives"),
    (FutureWarning, r"`torch\.distributed\._(all_gather|reduce_scatter)_base` is a private function",
     r"torch\.distributed\.c10d_logger", "DeepSpeed's ZeRO collectives (older DeepSpeed)"),
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree",
     "Lightning's own pytree helpers"),
    # a weight_norm layer's per-example vjp (per_sample/parametrized.py): torch.func runs that op's backward once per
    # example where it has no batching rule, exactly; it names no setting the user could change
    (UserWarning, r"There is a performance drop because we have not yet implemented the batching rule for "
     r"aten::_weight_norm_interface_backward", r"torch\.autograd\.graph", "torch.func's exact per-example fallback"),
    # Lightning's advice for a single file points to its converter, which drops the privacy ledger; ours keeps it
    # (lightning_dpzero.checkpoints.convert_zero_checkpoint_with_ledger, docs/privacy.md)
    (UserWarning, r"When saving the DeepSpeed Stage 3 checkpoint, each worker will save a shard",
     r"lightning\.pytorch\.strategies\.deepspeed", "advice that would lose the ledger"),
)


def filter_known_warnings() -> None:
    """Install the filters of :data:`KNOWN_WARNINGS` (once; later filters of the user's take precedence)."""
    installed = {(f[0], getattr(f[1], "pattern", None), f[2], getattr(f[3], "pattern", None)) for f in warnings.filters}
    for category, message, module, _why in KNOWN_WARNINGS:
        if ("ignore", message, category, module) not in installed:
            warnings.filterwarnings("ignore", message=message, category=category, module=module, append=True)


#: (logger, start of the message, why): log records dropped where they are emitted (a filter on that logger only).
KNOWN_LOG_RECORDS = (
    ("DeepSpeed", "Setting accelerator to CPU.",
     "DeepSpeed's accelerator guess on every rank, when no GPU is found; the run's accelerator is the Trainer's"),
    ("DeepSpeed", "**** You are using ZeRO with an untested optimizer",
     "Lightning allows every torch.optim optimizer under ZeRO; DeepSpeed warns for SGD and AdamW alike"),
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip:", "Lightning's advertisement of its cloud products"),
    ("lightning.fabric.utilities.rank_zero", "💡 Tip:", "the same, where Fabric's own logger says it"),
    ("lightning.pytorch.trainer.connectors.checkpoint_connector", "`weights_only` was not set",
     "said by every rank at every save_checkpoint; the checkpoint holds the ledger either way"),
)


class _DropKnown(logging.Filter):
    """Drops the records of one logger whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def filter_known_log_records() -> None:
    """Install the filters of :data:`KNOWN_LOG_RECORDS` (once per logger). Before DeepSpeed is first imported:
    its accelerator line is logged then."""
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, start, _why in KNOWN_LOG_RECORDS:
        by_logger[name] = by_logger.get(name, ()) + (start,)
    for name, starts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(starts))
