"""DP checkpoints: the names of their files, the commit marker, safe loading, the save/load protocol, and the
export of consolidated weights with their ledger (docs/design.md, *Checkpoints*; docs/reliability.md).

* :func:`verify_checkpoint` checks a checkpoint directory without loading it (the checks loading runs);
* :func:`convert_zero_checkpoint_with_ledger` exports fp32 weights with the ledger, :func:`exported_ledger`
  verifies such an export, :func:`checkpoint_ledger` reads a checkpoint directory's verified ledger;
* :class:`CheckpointProtocol` is what :class:`~lightning_dpzero.DPDeepSpeedStrategy` saves and loads with.

The names are imported when first used, so that reading a file name or a ledger copy (the ``lightning-dpzero
ledger`` command) does not import Lightning and torch along with the protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..util.lazy import lazy_exports

_EXPORTS = {
    "CheckpointIntegrityError": "commit", "IncompleteCheckpointError": "commit", "verify_checkpoint": "verify",
    "ExportedCheckpoint": "export", "convert_zero_checkpoint_with_ledger": "export", "exported_ledger": "export",
    "COMMIT_FILE": "format", "INCOMPLETE_FILE": "format", "LEDGER_FILE": "format", "LEDGER_KEY": "format",
    "CheckpointProtocol": "protocol",
    "CheckpointReadError": "reader", "checkpoint_ledger": "reader", "client_state_ledgers": "reader",
    "ledgers_in_state": "reader",
    "UnsafeCheckpointError": "safe_load",
}

__all__ = ["COMMIT_FILE", "INCOMPLETE_FILE", "LEDGER_FILE", "LEDGER_KEY", "CheckpointIntegrityError",
           "CheckpointProtocol", "CheckpointReadError", "ExportedCheckpoint", "IncompleteCheckpointError",
           "UnsafeCheckpointError", "checkpoint_ledger", "client_state_ledgers", "convert_zero_checkpoint_with_ledger",
           "exported_ledger", "ledgers_in_state", "verify_checkpoint"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)


if TYPE_CHECKING:
    from .commit import CheckpointIntegrityError, IncompleteCheckpointError
    from .export import ExportedCheckpoint, convert_zero_checkpoint_with_ledger, exported_ledger
    from .format import COMMIT_FILE, INCOMPLETE_FILE, LEDGER_FILE, LEDGER_KEY
    from .protocol import CheckpointProtocol
    from .reader import CheckpointReadError, checkpoint_ledger, client_state_ledgers, ledgers_in_state
    from .safe_load import UnsafeCheckpointError
    from .verify import verify_checkpoint
