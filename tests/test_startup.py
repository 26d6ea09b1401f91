"""What the command line imports: ``lightning-dpzero ledger``, ``plan`` and ``--help`` of both load neither
Lightning, DeepSpeed nor torch (they start in a fraction of a second), while ``import lightning_dpzero`` still
registers the ``dp_deepspeed*`` strategies, whichever of it and Lightning is imported first.

Each check runs in a fresh interpreter (this test process has imported everything already)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("lightning", "lightning.pytorch", "deepspeed", "torch", "torch.distributed")


def _run(code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _imported_by(argv: list[str]) -> list[str]:
    """The heavy modules in sys.modules after ``lightning_dpzero.cli.main(argv)`` (``--help`` exits: caught)."""
    code = (f"import sys, json, contextlib, io\nfrom lightning_dpzero.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    try:\n        status = main({argv!r})\n    except SystemExit as e:\n        status = e.code\n"
            f"print(json.dumps({{'status': status, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))")
    out = _run(code)
    assert out["status"] in (0, None), out
    return out["heavy"]


@pytest.fixture(scope="module")
def ledger_json(tmp_path_factory):
    from lightning_dpzero import PrivacyLedger

    led = PrivacyLedger(delta=1e-5, dataset_size=1000)
    led.charge(0.01, 1.1, steps=40)
    path = tmp_path_factory.mktemp("ledger") / "privacy_ledger.json"
    led.save(path)
    return str(path)


@pytest.mark.parametrize("argv", [["ledger", "--help"], ["ledger", "show", "--help"], ["plan", "--help"],
                                  ["wandb-summary", "--help"]])
def test_help_imports_no_framework(argv):
    assert _imported_by(argv) == []


def test_ledger_show_and_verify_of_a_json_file_import_no_framework(ledger_json):
    assert _imported_by(["ledger", "show", ledger_json]) == []
    assert _imported_by(["ledger", "verify", ledger_json]) == []


def test_plan_from_numbers_imports_no_framework():
    assert _imported_by(["plan", "--dataset-size", "60000", "--batch-size", "256", "--epochs", "3",
                         "--target-epsilon", "8"]) == []


def test_the_package_alone_imports_no_framework():
    code = ("import sys, json\nimport lightning_dpzero\nfrom lightning_dpzero import PrivacyLedger, "
            "calibrate_noise_multiplier\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    assert _run(code) == []


@pytest.mark.parametrize("first", ["lightning_dpzero", "lightning", "strategy_class"])
def test_strategies_are_registered_whichever_is_imported_first(first):
    """``Trainer(strategy="dp_deepspeed_stage_3")`` builds our strategy after ``import lightning_dpzero``, with
    Lightning imported before it, after it, or through the strategy class itself."""
    imports = {"lightning_dpzero": "import lightning_dpzero\nimport lightning as L\n",
               "lightning": "import lightning as L\nimport lightning_dpzero\n",
               "strategy_class": "from lightning_dpzero import DPDeepSpeedStrategy\nimport lightning as L\n"}[first]
    code = imports + (
        "import json\nfrom lightning.pytorch.strategies import StrategyRegistry\n"
        "import lightning.pytorch\n"
        "trainer = L.Trainer(strategy='dp_deepspeed_stage_3', accelerator='cpu', devices=1, logger=False,\n"
        "                    enable_progress_bar=False, enable_model_summary=False)\n"
        "print(json.dumps({'type': type(trainer.strategy).__name__, 'stage': trainer.strategy.zero_stage,\n"
        "  'registered': sorted(n for n in StrategyRegistry if n.startswith('dp_deepspeed')),\n"
        "  'same_class': StrategyRegistry['dp_deepspeed_stage_3']['strategy'] is lightning_dpzero_cls(),\n"
        "  'loader': type(lightning.pytorch.__loader__).__name__}))\n")
    code = "def lightning_dpzero_cls():\n    import lightning_dpzero\n    return lightning_dpzero.DPDeepSpeedStrategy\n" + code
    out = _run(code)
    assert out["type"] == "DPDeepSpeedStrategy" and out["stage"] == 3 and out["same_class"]
    assert out["registered"] == ["dp_deepspeed", "dp_deepspeed_stage_0", "dp_deepspeed_stage_1", "dp_deepspeed_stage_2",
                                 "dp_deepspeed_stage_2_offload", "dp_deepspeed_stage_3", "dp_deepspeed_stage_3_offload"]
    assert out["loader"] == "SourceFileLoader"  # Lightning's module keeps its own loader after the hook ran
