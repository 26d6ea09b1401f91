"""End-to-end checks of ``examples/fabric_digits.py``: the digits CNN in a Lightning Fabric loop on DeepSpeed
ZeRO-3, 2 CPU processes, real data (the example relaunches itself for rank 1, so it runs as a subprocess)."""

import re

import pytest

from test_digits_example import ROOT, run_digits

EXAMPLE = ROOT / "examples" / "fabric_digits.py"
pytestmark = pytest.mark.slow


def test_the_fabric_loop_learns_within_the_budget(tmp_path):
    out = run_digits("--checkpoint", str(tmp_path / "ckpt"), example=EXAMPLE)
    assert out["epsilon"] <= 8.0 and out["delta"] == 1e-5
    assert out["accuracy"] >= 0.85, out["stdout"]
    steps = int(re.search(r"(\d+) steps", out["stdout"])[1])
    # the checkpoint fabric.save wrote holds the ledger of every step, and passes the checks a resume runs
    from lightning_dpzero.checkpoints import checkpoint_ledger, verify_checkpoint

    commit = verify_checkpoint(tmp_path / "ckpt")
    assert commit["ledger_steps"] == commit["global_step"] == steps
    assert checkpoint_ledger(tmp_path / "ckpt").epsilon() == pytest.approx(out["epsilon"], abs=0.006)


def test_huge_noise_keeps_the_fabric_loop_at_chance():
    # sigma = 1000 drowns the clipped signal: a model that learns here would mean the noise missed the update
    out = run_digits("--noise-multiplier", "1000", "--epochs", "3", example=EXAMPLE)
    assert out["accuracy"] < 0.25, out["stdout"]
    assert out["epsilon"] < 0.01
