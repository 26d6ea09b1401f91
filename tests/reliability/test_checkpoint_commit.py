"""The commit marker without a training run: what ``verify_checkpoint`` refuses, and that deleting a checkpoint
invalidates it before anything else goes (docs/reliability.md §1)."""

import json
import os

import pytest
import torch

from lightning_dpzero import DPDeepSpeedStrategy, PrivacyLedger
from lightning_dpzero.checkpoints import (COMMIT_FILE, INCOMPLETE_FILE, LEDGER_FILE, CheckpointIntegrityError,
                                          IncompleteCheckpointError, verify_checkpoint)
from lightning_dpzero.checkpoints.commit import (checkpoint_files as _checkpoint_files, file_digest as _file_digest,
                                                 write_commit as _write_commit)


def _fake_checkpoint(root, steps=3):
    """A directory laid out like a saved checkpoint, committed the way save_checkpoint commits it."""
    (root / "checkpoint").mkdir(parents=True)
    ledger = PrivacyLedger(delta=1e-5, dataset_size=100)
    ledger.charge(0.1, 1.0, steps=steps)
    # the client state as DeepSpeed writes it: the module, the step counts, the ledger
    torch.save({"module": {"w": torch.zeros(2)}, "global_step": steps, "global_steps": steps,
                "privacy_ledger": ledger.to_dict()}, root / "checkpoint" / "mp_rank_00_model_states.pt")
    (root / "latest").write_text("checkpoint")
    ledger.save(root / LEDGER_FILE)
    files = {n: _file_digest(root / n) for n in _checkpoint_files(root)}
    _write_commit(root, {"format": "lightning_dpzero.privacy_commit", "format_version": 1, "global_step": steps,
                         "run_id": ledger.run_id, "ledger_head": ledger.head, "ledger_steps": ledger.steps,
                         "files": files})
    return ledger


def test_a_committed_directory_verifies(tmp_path):
    ledger = _fake_checkpoint(tmp_path)
    commit = verify_checkpoint(tmp_path)
    assert commit["ledger_steps"] == ledger.steps == commit["global_step"] == 3
    assert set(commit["files"]) == {"checkpoint/mp_rank_00_model_states.pt", "latest", LEDGER_FILE}


@pytest.mark.parametrize("damage, error, match", [
    (lambda d: (d / COMMIT_FILE).unlink(), IncompleteCheckpointError, "did not finish"),
    (lambda d: ((d / COMMIT_FILE).unlink(), (d / INCOMPLETE_FILE).touch()), IncompleteCheckpointError,
     "was interrupted"),
    (lambda d: (d / COMMIT_FILE).write_text("{not json"), CheckpointIntegrityError, "malformed"),
    (lambda d: (d / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"other"), CheckpointIntegrityError,
     "model_states.pt: size/SHA-256"),
    (lambda d: (d / "checkpoint" / "mp_rank_00_model_states.pt").unlink(), CheckpointIntegrityError, "missing"),
    (lambda d: (d / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"x"),
     CheckpointIntegrityError, "not covered by the commit"),
])
def test_damage_is_refused(tmp_path, damage, error, match):
    _fake_checkpoint(tmp_path)
    damage(tmp_path)
    with pytest.raises(error, match=match):
        verify_checkpoint(tmp_path)


def test_marker_naming_another_ledger_is_refused(tmp_path):
    _fake_checkpoint(tmp_path)
    commit = json.loads((tmp_path / COMMIT_FILE).read_text())
    commit["ledger_steps"] = 2
    (tmp_path / COMMIT_FILE).write_text(json.dumps(commit))
    with pytest.raises(CheckpointIntegrityError, match="ledger_steps: privacy_commit.json says 2"):
        verify_checkpoint(tmp_path)


def test_removing_a_checkpoint_invalidates_it_first(tmp_path, monkeypatch):
    """ModelCheckpoint deletes old top-k directories; a deletion killed half-way must not leave a directory that
    still verifies: the marker goes before any file."""
    _fake_checkpoint(tmp_path / "c")
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0)
    seen = {}

    def remove(path):
        seen["marker_at_removal"] = os.path.exists(os.path.join(path, COMMIT_FILE))
        raise KeyboardInterrupt  # killed before any file is deleted

    monkeypatch.setattr(strategy.checkpoint_io, "remove_checkpoint", remove)
    with pytest.raises(KeyboardInterrupt):
        strategy.remove_checkpoint(tmp_path / "c")
    assert seen == {"marker_at_removal": False}
    with pytest.raises(IncompleteCheckpointError):
        verify_checkpoint(tmp_path / "c")
