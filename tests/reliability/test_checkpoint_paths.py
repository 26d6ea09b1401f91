"""Every file DeepSpeed opens when loading a checkpoint is a regular file inside its directory, so the commit
marker's digests and the pickle scan cover it (docs/reliability.md, *Checkpoint paths*)."""

import json
import os
import shutil

import pytest
import torch

from lightning_dpzero import DPDeepSpeedStrategy
from lightning_dpzero.checkpoints import UnsafeCheckpointError, verify_checkpoint
from lightning_dpzero.checkpoints.commit import file_digest
from test_security import _Payload, _fit


@pytest.mark.parametrize("escape", ["tag", "symlinked_tag_folder"])
def test_a_checkpoint_whose_shards_lie_outside_it_is_refused_before_anything_is_unpickled(tmp_path, escape):
    """A sibling folder holds shards with a payload that creates a file when unpickled. The checkpoint reaches it
    through ``latest`` (``../sibling/checkpoint``) or through its tag folder replaced by a link to it; the one digest
    that changed (``latest``'s, or the shard's) is rewritten in the marker, as an attacker who can write the files
    would. Resuming, verifying (even trusting the pickles) and exporting refuse it; no code ran."""
    trainer, _ = _fit(DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), steps=2)
    ckpt, sibling = tmp_path / "ckpt", tmp_path / "sibling"
    trainer.save_checkpoint(ckpt)
    sentinel = tmp_path / "code_ran"
    shutil.copytree(ckpt / "checkpoint", sibling / "checkpoint")
    shard = next((sibling / "checkpoint").glob("*optim_states.pt"))
    state = torch.load(shard, weights_only=False)
    state["payload"] = _Payload(str(sentinel))
    torch.save(state, shard)
    commit = json.loads((ckpt / "privacy_commit.json").read_text())
    if escape == "tag":
        (ckpt / "latest").write_text("../sibling/checkpoint")
        commit["files"]["latest"] = file_digest(ckpt / "latest")
        expected = r"latest: the tag '\.\./sibling/checkpoint' names .*sibling.*outside the checkpoint directory"
    else:
        shutil.rmtree(ckpt / "checkpoint")
        os.symlink(sibling / "checkpoint", ckpt / "checkpoint", target_is_directory=True)
        name = f"checkpoint/{shard.name}"
        commit["files"][name] = file_digest(ckpt / name)
        expected = r"checkpoint: a symbolic link \(to .*sibling"
    (ckpt / "privacy_commit.json").write_text(json.dumps(commit))
    match = expected + r".*Nothing was unpickled"
    with pytest.raises(UnsafeCheckpointError, match=match):
        _fit(DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), steps=4, ckpt_path=ckpt)
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0)
    strategy.trust_checkpoint_pickles = True  # trusting the pickles does not trust files the checks never saw
    with pytest.raises(UnsafeCheckpointError, match=match):
        _fit(strategy, steps=4, ckpt_path=ckpt)
    with pytest.raises(UnsafeCheckpointError, match=match):
        verify_checkpoint(ckpt, trust=True)
    from lightning_dpzero.checkpoints import convert_zero_checkpoint_with_ledger

    with pytest.raises(UnsafeCheckpointError, match=match):
        convert_zero_checkpoint_with_ledger(ckpt, tmp_path / "model.ckpt")
    assert not sentinel.exists(), "loading the checkpoint ran code from outside it"


def test_what_counts_as_a_path_outside_the_checkpoint(tmp_path):
    """Only names are read: an absolute tag, the directory itself, a file as the tag, a linked shard are refused; a
    checkpoint directory reached through a link (Lightning's ``save_last="link"``) is not."""
    from lightning_dpzero.checkpoints.safe_load import escaping_paths

    real = tmp_path / "real"
    (real / "checkpoint").mkdir(parents=True)
    (real / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (real / "latest").write_text("checkpoint")
    os.symlink(real, tmp_path / "last.ckpt", target_is_directory=True)
    assert escaping_paths(real) == escaping_paths(tmp_path / "last.ckpt") == []
    for tag, why in [(str(tmp_path), "outside the checkpoint directory"), (".", "the checkpoint directory itself"),
                     ("checkpoint/mp_rank_00_model_states.pt", "which is not a folder")]:
        (real / "latest").write_text(tag)
        assert [why in p for p in escaping_paths(real)] == [True], tag
    (real / "latest").write_text("checkpoint")
    os.symlink(tmp_path / "elsewhere.pt", real / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert escaping_paths(real) == [f"checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt: a symbolic link (to "
                                    f"{tmp_path / 'elsewhere.pt'})"]
