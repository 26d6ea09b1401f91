"""End-to-end checks of ``examples/digits.py`` (ZeRO-3, 2 CPU processes, real data).

The example runs as a subprocess: Lightning re-launches the running script for rank 1, which must be the
example, not pytest. Its last stdout line is ``accuracy=A epsilon=E delta=D``; before it, rank 0 prints a line per
epoch with ε, and the checkpoint it saved (into the test's directory: ``--checkpoint``).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gloo_exit import run_with_one_retry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "digits.py"
FINAL = re.compile(r"^accuracy=(\d+\.\d\d) epsilon=(\d+\.\d\d) delta=(\S+)$")
EPOCH = re.compile(r"^epoch (\d+)/(\d+): epsilon=(\d+\.\d\d) \((\d+) steps, \d+ s\)$", re.M)
# An in-process Trainer in an earlier test leaves these set (and its TCPStore listening on MASTER_PORT); the
# example must pick its own rendezvous, and must not take itself for a relaunched rank.
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
              "LOCAL_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def _run(args, timeout, example=EXAMPLE):
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run([sys.executable, str(example), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def run_digits(*args: str, timeout: float = 300, example: Path = EXAMPLE) -> dict:
    """Run ``example`` (default examples/digits.py) with ``args``; its final line's numbers and its stdout."""
    proc = run_with_one_retry(lambda: _run(args, timeout, example), f"{example.name} {' '.join(args)}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = proc.stdout.strip().splitlines()
    match = FINAL.match(lines[-1]) if lines else None
    assert match, f"last line is not 'accuracy=.. epsilon=.. delta=..':\n{proc.stdout[-3000:]}"
    return {"accuracy": float(match[1]), "epsilon": float(match[2]), "delta": float(match[3]),
            "stdout": proc.stdout}


@pytest.mark.slow
def test_huge_noise_keeps_accuracy_at_chance():
    # sigma = 1000: the noise (std sigma*C/B_exp per coordinate, each step) drowns the clipped signal, so a
    # model that learns anything here would mean the noise did not reach the update.
    out = run_digits("--noise-multiplier", "1000", "--epochs", "3", "--checkpoint", "")
    assert out["accuracy"] < 0.25, out["stdout"]
    assert out["epsilon"] < 0.01


@pytest.mark.slow
def test_dp_training_learns_within_budget(tmp_path):
    checkpoint = tmp_path / "digits.ckpt"
    out = run_digits("--epochs", "3", "--target-epsilon", "8", "--checkpoint", str(checkpoint))
    assert out["accuracy"] >= 0.6, out["stdout"]
    assert 7.9 <= out["epsilon"] <= 8.0  # calibrated: at most the target, within 1% of it
    assert out["delta"] == 1e-5
    # a progress line per epoch (rank 0 only: once each), ε growing to the final one
    epochs = [(int(e), int(n), float(eps), int(steps)) for e, n, eps, steps in EPOCH.findall(out["stdout"])]
    assert [(e, n) for e, n, _, _ in epochs] == [(1, 3), (2, 3), (3, 3)], out["stdout"]
    assert 0 < epochs[0][2] < epochs[1][2] < epochs[2][2] == out["epsilon"]
    assert 0 < epochs[0][3] < epochs[1][3] < epochs[2][3]
    # the checkpoint it names, whose ledger `lightning-dpzero ledger show` reads: the steps and ε of the run
    assert f"lightning-dpzero ledger show {checkpoint}" in out["stdout"]
    show = subprocess.run([sys.executable, "-m", "lightning_dpzero.cli", "ledger", "show", str(checkpoint)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert show.returncode == 0, show.stdout + show.stderr
    assert re.search(rf"^total steps:\s+{epochs[2][3]}$", show.stdout, re.M), show.stdout
    shown = float(re.search(r"^epsilon \(pld\):\s+(\S+)", show.stdout, re.M)[1])
    assert f"{shown:.2f}" == f"{out['epsilon']:.2f}", show.stdout
