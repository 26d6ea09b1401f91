"""DP checkpoints: the names of their files, the commit marker, safe loading, the save/load protocol, and the
export of consolidated weights with their ledger (docs/design.md, *Checkpoints*; docs/reliability.md).

* :func:`verify_checkpoint` checks a checkpoint directory without loading it (the checks loading runs);
* :func:`convert_zero_checkpoint_with_ledger` exports fp32 weights with the ledger, :func:`exported_ledger`
  verifies such an export, :func:`checkpoint_ledger` reads a checkpoint directory's verified ledger;
* :class:`CheckpointProtocol` is what :class:`~lightning_dpzero.DPDeepSpeedStrategy` saves and loads with.
"""

from .commit import CheckpointIntegrityError, IncompleteCheckpointError
from .export import ExportedCheckpoint, convert_zero_checkpoint_with_ledger, exported_ledger
from .format import COMMIT_FILE, INCOMPLETE_FILE, LEDGER_FILE, LEDGER_KEY
from .protocol import CheckpointProtocol
from .reader import CheckpointReadError, checkpoint_ledger, client_state_ledgers, ledgers_in_state
from .safe_load import UnsafeCheckpointError
from .verify import verify_checkpoint

__all__ = ["COMMIT_FILE", "INCOMPLETE_FILE", "LEDGER_FILE", "LEDGER_KEY", "CheckpointIntegrityError",
           "CheckpointProtocol", "CheckpointReadError", "ExportedCheckpoint", "IncompleteCheckpointError",
           "UnsafeCheckpointError", "checkpoint_ledger", "client_state_ledgers", "convert_zero_checkpoint_with_ledger",
           "exported_ledger", "ledgers_in_state", "verify_checkpoint"]
