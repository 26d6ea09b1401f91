"""What fault injection on 2-process ZeRO runs found (docs/reliability.md §1 and §2): accumulation windows cut by
an epoch or a resume position, a checkpoint whose marker was removed and whose shards were mixed, a ledger forged
below the weights' step count, and a resume on another number of processes.

Three launches of ``crash_worker.py`` share the work: 2 processes (the windows cases, and the checkpoints the
others use), 1 process (resumes of 2-process checkpoints, and 1-process checkpoints), 2 processes (their resumes,
and the mixed directory).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from crash_harness import launch, results
from lightning_dpzero import PrivacyLedger
from lightning_dpzero.accounting import compute_epsilon
from lightning_dpzero.accounting.ledger import LedgerEntry
from lightning_dpzero.checkpoints import COMMIT_FILE, LEDGER_FILE, verify_checkpoint
from lightning_dpzero.checkpoints.commit import checkpoint_files, file_digest
from lightning_dpzero.cli import main

pytestmark = pytest.mark.slow

BASE = dict(model="token", n=64, batch_size=4, lr=0.5, sigma=1.0, C=0.5, stage=2, steps=-1, seed=1234)
RANK1_OPTIM = "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    out = root / "out"
    ck = {name: str(root / f"{name}.ckpt") for name in ("k1_odd", "k1_even", "s0_w2", "s0_w1", "s2_w1")}
    first = [
        # an epoch of 5 micro-batches with accumulate_grad_batches=2: refused before training
        dict(BASE, name="cut", accumulate=2, limit_train_batches=5, max_epochs=3),
        # whole windows over 3 epochs: the ledger, Lightning and DeepSpeed count the same 6 updates
        dict(BASE, name="whole", accumulate=2, limit_train_batches=4, max_epochs=3),
        # K=1 checkpoints at an odd and an even position of the epoch, resumed with K=2
        dict(BASE, name="k1_odd", steps=3, save_path=ck["k1_odd"]),
        dict(BASE, name="k1_even", steps=2, save_path=ck["k1_even"]),
        dict(BASE, name="resume_odd", accumulate=2, steps=6, resume_from=ck["k1_odd"]),
        dict(BASE, name="resume_even", accumulate=2, steps=4, resume_from=ck["k1_even"]),
        # a checkpoint after every step (for the mixed and the forged directories, and a ZeRO-2 one of 2 ranks)
        dict(BASE, name="every", steps=4, ckpt_dir=str(root / "every")),
        dict(BASE, name="s0_w2", stage=0, steps=3, save_path=ck["s0_w2"]),
    ]
    res_first = launch(first, out, world_size=2)
    assert not any(res_first["codes"]), res_first["log"]

    # the mixed directory: step=2's, without its marker and ledger file, with rank 1's optimizer shard of step=4
    every = root / "every"
    mixed = root / "mixed"
    shutil.copytree(every / "step=2.ckpt", mixed)
    (mixed / COMMIT_FILE).unlink()
    (mixed / LEDGER_FILE).unlink()
    shutil.copy(every / "step=4.ckpt" / RANK1_OPTIM, mixed / RANK1_OPTIM)
    mixed_with_json = root / "mixed_with_json"  # the same, privacy_ledger.json kept (what `ledger verify` reads)
    shutil.copytree(mixed, mixed_with_json)
    shutil.copy(every / "step=2.ckpt" / LEDGER_FILE, mixed_with_json / LEDGER_FILE)

    second = [
        dict(BASE, name="s0_to1", stage=0, steps=6, resume_from=ck["s0_w2"]),
        dict(BASE, name="s2_to1", steps=6, resume_from=str(every / "step=3.ckpt")),
        dict(BASE, name="s0_w1", stage=0, steps=3, save_path=ck["s0_w1"]),
        dict(BASE, name="s2_w1", steps=3, save_path=ck["s2_w1"]),
    ]
    res_second = launch(second, out, world_size=1)
    assert not any(res_second["codes"]), res_second["log"]
    third = [
        dict(BASE, name="s0_to2", stage=0, steps=6, resume_from=ck["s0_w1"]),
        dict(BASE, name="s2_to2", steps=6, resume_from=ck["s2_w1"]),
        dict(BASE, name="mixed", steps=6, resume_from=str(mixed)),
    ]
    res_third = launch(third, out, world_size=2)
    assert not any(res_third["codes"]), res_third["log"]
    world = {c["name"]: 2 for c in first + third} | {c["name"]: 1 for c in second}
    return {"root": root, "every": every, "mixed": mixed, "mixed_with_json": mixed_with_json, "ck": ck,
            "ranks": {name: results(out, name, world[name]) for name in world}}


def _ok(runs, name):
    ranks = runs["ranks"][name]
    assert all(r is not None and r["ok"] for r in ranks), [r and r.get("traceback") for r in ranks]
    assert all(r["ledger"] == ranks[0]["ledger"] for r in ranks)
    return ranks[0]


def _refused(runs, name, error_type, match):
    ranks = runs["ranks"][name]
    for r in ranks:  # the same clear error on every rank, before any update
        assert r is not None and not r["ok"], f"{name} trained instead of being refused"
        assert r["error_type"] == error_type, r["traceback"]
        assert match in r["error"], r["error"]
    assert len({r["error"] for r in ranks}) == 1
    return ranks


def _steps(record):
    return sum(e["steps"] for e in record["ledger"]["entries"])


# ------------------------------------------------------------------------------------------- accumulation windows
def test_an_epoch_that_cuts_a_window_is_refused_with_the_fix(runs):
    for r in _refused(runs, "cut", "ValueError", "limit_train_batches=4 or 6, a multiple of accumulate_grad_batches=2"):
        assert r["global_step"] == 0 and "runs 5 micro-batches per epoch" in r["error"]


def test_whole_windows_across_epochs_count_alike(runs):
    r = _ok(runs, "whole")
    assert _steps(r) == r["global_step"] == r["deepspeed_global_steps"] == 6


def test_a_resume_inside_a_window_is_refused(runs):
    for r in _refused(runs, "resume_odd", "ValueError", "starts at micro-batch 3 of epoch "):
        assert r["global_step"] == 3  # the checkpoint's, restored; nothing trained after it
        assert _steps(r) == 3


def test_a_resume_at_a_window_start_with_another_k_counts_alike(runs):
    r = _ok(runs, "resume_even")
    assert _steps(r) == r["global_step"] == r["deepspeed_global_steps"] == 4
    q1 = BASE["batch_size"] * 2 / BASE["n"]
    assert [(e["sample_rate"], e["steps"]) for e in r["ledger"]["entries"]] == [(q1, 2), (2 * q1, 2)]


# ------------------------------------------------------------------------------------------- marker-less, forged
def test_a_directory_without_its_marker_is_refused_even_with_mixed_shards(runs):
    _refused(runs, "mixed", "IncompleteCheckpointError", "was written by DPDeepSpeedStrategy")
    with pytest.raises(Exception, match="no privacy_commit.json"):
        verify_checkpoint(runs["mixed"])


def _forge(src, dst, steps):
    """A consistent-looking forgery: every ledger copy replaced by one of ``steps`` steps (valid hash chain, the
    same run id), and the marker rewritten to match every file; the weights' global_step is left as it is."""
    shutil.copytree(src, dst)
    real = PrivacyLedger.load(dst / LEDGER_FILE)
    forged = PrivacyLedger(delta=real.delta, dataset_size=real.dataset_size, run_id=real.run_id)
    entry = real.entries[0]
    forged.charge(entry.sample_rate, entry.noise_multiplier, entry.sampler, steps=steps)
    forged.save(dst / LEDGER_FILE)
    states = dst / "checkpoint" / "mp_rank_00_model_states.pt"
    state = torch.load(states, weights_only=True)
    state["privacy_ledger"] = forged.to_dict()
    state["callbacks"]["PrivacyAccountantCallback"]["ledger"] = forged.to_dict()
    torch.save(state, states)
    commit = json.loads((dst / COMMIT_FILE).read_text())
    commit.update(ledger_steps=forged.steps, ledger_head=forged.head,
                  files={n: file_digest(dst / n) for n in checkpoint_files(dst)})
    (dst / COMMIT_FILE).write_text(json.dumps(commit))
    return state["global_step"]


def test_ledger_verify_fails_where_resuming_refuses(runs, tmp_path, capsys):
    good = runs["every"] / "step=4.ckpt"
    assert main(["ledger", "verify", str(good)]) == 0
    assert "covering the weights' 4 steps" in capsys.readouterr().out

    assert main(["ledger", "verify", str(runs["mixed_with_json"])]) == 1
    assert "INCOMPLETE" in capsys.readouterr().err
    assert main(["ledger", "verify", str(runs["mixed"])]) == 1  # no ledger file at all
    capsys.readouterr()

    forged = tmp_path / "forged"
    assert _forge(good, forged, steps=1) == 4
    assert main(["ledger", "verify", str(forged)]) == 1
    err = capsys.readouterr().err
    assert "MISMATCH" in err and "holds weights after 4 optimizer steps but its privacy ledger charges only 1" in err


# ------------------------------------------------------------------------------------------- another world size
def _epsilon(entries, delta=1e-5):
    return compute_epsilon([LedgerEntry(e["sample_rate"], e["noise_multiplier"], e["steps"], e["sampler"])
                            for e in entries], delta, "pld")


@pytest.mark.parametrize("name, before, after", [("s0_to1", 2, 1), ("s0_to2", 1, 2)])
def test_stage0_resumes_on_another_number_of_processes(runs, name, before, after):
    """The ledger continues; q = B·W·K/N is recomputed for the new W and charged as a new entry; ε covers both."""
    r = _ok(runs, name)
    q = BASE["batch_size"] / BASE["n"]
    entries = r["ledger"]["entries"]
    assert [(e["sample_rate"], e["steps"]) for e in entries] == [(q * before, 3), (q * after, 3)]
    assert _steps(r) == r["global_step"] == 6
    assert r["plan"]["sample_rate"] == q * after
    assert r["epsilon"] == pytest.approx(_epsilon(entries), rel=1e-9)
    assert r["epsilon"] > _epsilon(entries[:1])


@pytest.mark.parametrize("name, saved, now, ckpt", [("s2_to1", 2, 1, "every/step=3.ckpt"),
                                                     ("s2_to2", 1, 2, "s2_w1.ckpt")])
def test_zero_shards_of_another_number_of_processes_are_refused_before_loading(runs, name, saved, now, ckpt):
    for r in _refused(runs, name, "ValueError", f"written by {saved} processes; this run has {now}"):
        assert "convert_zero_checkpoint_with_ledger" in r["error"] and f"Resume it on {saved} processes" in r["error"]
        assert r["global_step"] == 0
    commit = verify_checkpoint(Path(runs["root"]) / ckpt)  # the checkpoint and its ledger are untouched
    assert commit["ledger_steps"] == commit["global_step"] == 3
