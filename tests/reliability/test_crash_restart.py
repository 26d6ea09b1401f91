"""Crash and restart (issue #5, docs/reliability.md §1): real SIGKILLs on a 2-process ZeRO-2 CPU run.

A run checkpoints after every optimizer step (``step=K.ckpt`` plus ``last.ckpt`` overwritten in place) and is
killed mid-step, mid-checkpoint-write on one rank only, just before the commit marker, and at a random moment.
Then, for every checkpoint directory left behind:

* either it verifies (``privacy_commit.json`` present, every file matching its SHA-256) and then its weights are
  exactly the run's parameters after ``global_step`` optimizer steps, and its ledger charges at least that
  many steps (the ledger is charged before the update, so a checkpoint's ledger covers its weights);
* or it is refused, on every rank, with a clear error before anything is loaded.

Resuming from the last good checkpoint finishes the run with a ledger that charges at least every step whose
update is in the final model, so the ε it reports is never below what the released models spent.
"""

import os
import random
from pathlib import Path

import pytest
import torch

from crash_harness import launch, results
from lightning_dpzero import PrivacyLedger
from lightning_dpzero.accounting import compute_epsilon
from lightning_dpzero.accounting.ledger import LedgerEntry
from lightning_dpzero.checkpoints import CheckpointIntegrityError, IncompleteCheckpointError, verify_checkpoint

pytestmark = pytest.mark.slow

BASE = dict(model="token", n=64, batch_size=4, lr=0.5, sigma=1.0, C=0.5, stage=2, steps=5, seed=1234)

# name: (kill spec, the directory the kill leaves half-written, the checkpoint to resume from or refuse)
SCENARIOS = {
    "midstep": (dict(rank=0, at="step", step=4), None, "last.ckpt"),
    # rank 0 dies before overwriting its files of last.ckpt while rank 1 overwrites its own: old and new mixed
    "overwrite": (dict(rank=0, at="shard", step=3, match="last.ckpt", keep=0), "last.ckpt", "step=3.ckpt"),
    # one rank only: rank 1 dies half-way through writing its shard of step=3.ckpt
    "one_rank": (dict(rank=1, at="shard", step=3, match="step=3.ckpt"), "step=3.ckpt", "last.ckpt"),
    "commit": (dict(rank=0, at="commit", step=2), "step=2.ckpt", "step=1.ckpt"),
}


def _weights(ckpt):
    """The module weights a ZeRO-2 checkpoint holds (rank 0's model states), keyed like named_parameters."""
    state = torch.load(Path(ckpt) / "checkpoint" / "mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=True)["module"]
    return {k[k.index("net."):]: v.float() for k, v in state.items() if "net." in k}


def _trajectory(traj_dir):
    return {int(f.stem): torch.load(f, weights_only=True) for f in Path(traj_dir).glob("*.pt")}


def _matching_step(weights, trajectory):
    hits = [step for step, params in trajectory.items()
            if params.keys() == weights.keys() and all(torch.equal(params[k], weights[k]) for k in params)]
    assert len(hits) <= 1, hits
    return hits[0] if hits else None


def check_checkpoints(ckpt_dir, traj_dir):
    """Every directory: verified and consistent (weights after exactly global_step updates, ledger >= that),
    or refused. Returns ({name: global_step} of the good ones, [names refused])."""
    trajectory = _trajectory(traj_dir)
    good, refused = {}, []
    for d in sorted(Path(ckpt_dir).iterdir()):
        try:
            commit = verify_checkpoint(d)
        except (IncompleteCheckpointError, CheckpointIntegrityError):
            refused.append(d.name)
            continue
        step = _matching_step(_weights(d), trajectory)
        assert step is not None, f"{d.name}: verified, but its weights are no state the run was ever in"
        ledger = PrivacyLedger.load(d / "privacy_ledger.json")
        assert commit["global_step"] == step, (d.name, commit["global_step"], step)
        assert ledger.steps == commit["ledger_steps"] >= step, (d.name, ledger.steps, step)
        good[d.name] = step
    return good, refused


def _epsilon_of(steps, plan):
    entries = [LedgerEntry(plan["sample_rate"], plan["noise_multiplier"], steps, plan["sampler_kind"])]
    return compute_epsilon(entries, plan["delta"], plan["accountant"]) if steps else 0.0


def _assert_resumed(out, name, weights_steps):
    """Both ranks finished; the ledger charges every step in the final model; ε is that of those steps."""
    ranks = results(out, name)
    assert all(r is not None and r["ok"] for r in ranks), [r and r.get("traceback") for r in ranks]
    r0 = ranks[0]
    ledger = PrivacyLedger.from_dict(r0["ledger"])
    assert r0["global_step"] == weights_steps
    assert ledger.steps >= weights_steps
    assert r0["epsilon"] >= _epsilon_of(weights_steps, r0["plan"]) * (1 - 1e-9)
    assert ranks[1]["ledger"] == r0["ledger"]


def _assert_refused(out, name, ckpt):
    ranks = results(out, name)
    for r in ranks:
        assert r is not None and not r["ok"], f"{ckpt} was used instead of refused"
        assert r["error_type"] == "IncompleteCheckpointError", r["traceback"]
        assert "privacy_commit.json" in r["error"] and "Nothing was loaded" in r["error"]
        assert r["global_step"] == 0


def test_kill_minus_nine_then_resume(tmp_path):
    rng_seed = int(os.environ.get("DPZERO_RELIABILITY_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(rng_seed)
    out = tmp_path / "out"
    resume_cases = []

    for name, (kill, broken, resume_from) in SCENARIOS.items():
        ckpt_dir = tmp_path / name
        res = launch([dict(BASE, name=name, ckpt_dir=str(ckpt_dir), kill=kill)], out)
        assert -9 in res["codes"], (name, res["codes"], res["log"])
        good, refused = check_checkpoints(ckpt_dir, out / f"{name}.traj")
        assert refused == ([broken] if broken else []), (name, refused)
        last_good = max(good.values())
        assert last_good >= kill["step"] - 1, (name, good)  # nothing before the kill was lost
        if resume_from in good:
            resume_cases.append(dict(BASE, name=f"resume_{name}", resume_from=str(ckpt_dir / resume_from)))
        if broken:
            resume_cases.append(dict(BASE, name=f"refuse_{name}", resume_from=str(ckpt_dir / broken)))

    # a random rank killed at a random moment of the training (uniform over its expected duration, measured from
    # the first scenario: the time its first three steps and their checkpoints took)
    traj = out / "midstep.traj"
    per_step = ((traj / "3.pt").stat().st_mtime - (traj / "started").stat().st_mtime) / 3
    ckpt_dir = tmp_path / "random"
    started = out / "random.traj" / "started"
    res = launch([dict(BASE, name="random", steps=6, ckpt_dir=str(ckpt_dir))], out,
                 random_kill=(rng, started, 6 * per_step))
    context = f"seed {rng_seed}, killed {res['killed']}, codes {res['codes']}"
    assert res["killed"] is not None or not any(res["codes"]), context
    good, refused = check_checkpoints(ckpt_dir, out / "random.traj") if ckpt_dir.exists() else ({}, [])
    assert len(refused) <= 1, (context, refused)  # only the directory being written at the kill
    print(f"\nrandom kill: {context}; good {sorted(good.items())}; refused {refused}")
    if good:
        latest = max(good, key=lambda d: (good[d], d != "last.ckpt"))
        resume_cases.append(dict(BASE, name="resume_random", steps=6, resume_from=str(ckpt_dir / latest)))

    res = launch(resume_cases, out)
    assert not any(res["codes"]), res["log"]
    for case in resume_cases:
        name = case["name"]
        if name.startswith("refuse_"):
            _assert_refused(out, name, case["resume_from"])
        else:
            _assert_resumed(out, name, case["steps"])
