"""W&B offline logging of a DP run, read back from the run's transaction log (``run-<id>.wandb``).

The example runs as a subprocess through the CLI (Lightning relaunches the running command for rank 1, so
it must not be pytest): the Shakespeare GPT, shrunk, 5 steps, with ``examples/configs/wandb.yaml``
(``WandbLogger(offline=True)``). wandb 0.31 ships no Python reader for its offline files; the package's
:mod:`lightning_dpzero.wandb_offline` parses them (and ``lightning-dpzero wandb-summary`` prints them).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("wandb")

from lightning_dpzero.wandb_offline import read_run, series  # noqa: E402


@pytest.fixture(scope="module")
def wandb_dir(tmp_path_factory):
    """The offline run directory of a 5-step run, and the run's stdout."""
    tmp = tmp_path_factory.mktemp("wandb")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONWARNINGS="ignore", WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp),
               WANDB_DATA_DIR=str(tmp / "data"), WANDB_CACHE_DIR=str(tmp / "cache"),
               WANDB_CONFIG_DIR=str(tmp / "config"), WANDB_DISABLE_GIT="true")
    cmd = [sys.executable, "-m", "lightning_dpzero.cli", "fit",
           "--config", "examples/configs/shakespeare_gpt.yaml", "--config", "examples/configs/wandb.yaml",
           f"--trainer.logger.init_args.save_dir={tmp}", "--trainer.max_steps=5", "--trainer.val_check_interval=5",
           "--trainer.enable_progress_bar=false", "--data.max_train_examples=1024", "--data.batch_size=32",
           "--model.d_model=32", "--model.n_layers=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    files = sorted((tmp / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline run under {tmp / 'wandb'}, found {files}"
    return files[0].parent, proc.stdout


@pytest.fixture(scope="module")
def wandb_run(wandb_dir):
    run_dir, stdout = wandb_dir
    return read_run(next(run_dir.glob("run-*.wandb"))), stdout


@pytest.mark.slow
def test_epsilon_and_dp_series_every_step(wandb_run):
    run, _ = wandb_run
    eps = series(run["history"], "epsilon")
    assert len(eps) == 5, eps  # log_every_n_steps=1: one value per optimizer step
    assert all(b >= a for a, b in zip(eps, eps[1:])) and 0 < eps[-1] <= 8.0
    for key in ("noise_multiplier", "sample_rate", "clip_fraction", "dp_steps"):
        assert len(series(run["history"], key)) == 5, key
    assert series(run["history"], "dp_steps") == [1, 2, 3, 4, 5]
    assert all(0.0 <= c <= 1.0 for c in series(run["history"], "clip_fraction"))
    q = series(run["history"], "sample_rate")[0]
    assert q == pytest.approx(32 * 2 / 1024)


@pytest.mark.slow
def test_throughput_series(wandb_run):
    run, _ = wandb_run
    # ThroughputMonitor(window_size=4): a value once 4 batches are in the window, so at steps 4 and 5
    for key in ("train/samples_per_sec", "train/items_per_sec", "train/device/samples_per_sec"):
        values = series(run["history"], key)
        assert len(values) >= 2 and all(v > 0 for v in values), (key, values)
    tokens = series(run["history"], "train/items_per_sec")[-1]
    samples = series(run["history"], "train/samples_per_sec")[-1]
    assert tokens == pytest.approx(64 * samples)  # tokens/s = seq_len x samples/s


@pytest.mark.slow
def test_run_config_records_dp_settings(wandb_run):
    run, _ = wandb_run
    dp = run["config"]["dp"]
    eps_final = series(run["history"], "epsilon")[-1]
    assert dp["max_grad_norm"] == 1.0 and dp["delta"] == 1e-5 and dp["target_epsilon"] == 8.0
    assert dp["noise_multiplier"] == pytest.approx(series(run["history"], "noise_multiplier")[0], rel=1e-6)
    assert dp["sample_rate"] == pytest.approx(64 / 1024) and dp["dataset_size"] == 1024
    assert dp["zero_stage"] == 3 and dp["world_size"] == 2 and dp["planned_steps"] == 5
    assert dp["clipping"] == "layer-wise" and dp["sampler"] == "poisson" and dp["accountant"] == "pld"
    assert run["config"].get("d_model") == 32  # the model's own hyperparameters are there too
    assert 0 < eps_final <= 8.0


@pytest.mark.slow
def test_ledger_is_attached_as_artifact(wandb_run):
    from lightning_dpzero import PrivacyLedger

    run, stdout = wandb_run
    arts = [a for a in run["artifacts"] if a.type == "privacy-ledger"]
    assert len(arts) == 1, [(a.type, a.name) for a in run["artifacts"]]
    art = arts[0]
    entries = {c.path: c for c in art.manifest.contents}
    assert set(entries) == {"privacy_ledger.json"}
    ledger = PrivacyLedger.from_json(Path(entries["privacy_ledger.json"].local_path).read_text())  # hash chain checked
    assert ledger.steps == 5 and ledger.delta == 1e-5 and ledger.dataset_size == 1024
    meta = json.loads(art.metadata)
    assert meta["steps"] == 5 and meta["epsilon"] == pytest.approx(ledger.epsilon())
    assert run["summary"]["final_epsilon"] == pytest.approx(ledger.epsilon())
    final = [ln for ln in stdout.splitlines() if ln.startswith("val_perplexity=")]
    assert len(final) == 1, stdout[-3000:]
    assert math.isclose(float(final[0].split("epsilon=")[1].split()[0]), ledger.epsilon(), abs_tol=1e-3)


@pytest.mark.slow
def test_wandb_summary_prints_the_dp_series_and_the_ledger(wandb_dir, wandb_run, capsys):
    """`lightning-dpzero wandb-summary RUN_DIR`: the logged ε, δ, σ, q per step and the verified ledger."""
    from lightning_dpzero.cli import main
    from lightning_dpzero.wandb_offline import offline_run_summary

    run_dir, _ = wandb_dir
    run, _ = wandb_run
    s = offline_run_summary(run_dir.parent.parent)  # the logger's save_dir: one offline run below it
    assert [v for _, v in s["series"]["epsilon"]] == series(run["history"], "epsilon")
    assert [step for step, _ in s["series"]["dp_steps"]] == [0, 1, 2, 3, 4]  # trainer/global_step of each row
    for key in ("delta", "noise_multiplier", "sample_rate"):
        assert len(s["series"][key]) == 5, key
    assert s["dp_config"]["max_grad_norm"] == 1.0 and s["summary"]["final_dp_steps"] == 5
    assert s["ledger"].steps == 5 and s["summary"]["final_epsilon"] == pytest.approx(s["ledger"].epsilon())
    assert main(["wandb-summary", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "privacy ledger:" in out and s["ledger"].run_id in out and "noise_multiplier" in out
    assert main(["wandb-summary", "--json", str(run_dir)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["ledger"]["steps"] == 5 and printed["ledger"]["epsilon"] == s["ledger"].epsilon()
    assert len(printed["series"]["epsilon"]) == 5


@pytest.mark.slow
def test_the_run_directory_holds_its_ledger_without_wandbs_staging_area(wandb_dir, wandb_run, tmp_path):
    """PrivacyRunLogger saves the ledger among the run's files too; the reader falls back to that copy."""
    import shutil

    from lightning_dpzero import PrivacyLedger
    from lightning_dpzero.wandb_offline import offline_run_summary

    run_dir, _ = wandb_dir
    run, _ = wandb_run
    (art,) = [a for a in run["artifacts"] if a.type == "privacy-ledger"]
    staged = Path(art.manifest.contents[0].local_path)
    copy = run_dir / "files" / "privacy_ledger.json"
    assert PrivacyLedger.load(copy) == PrivacyLedger.load(staged)
    moved = tmp_path / "staged.json"
    shutil.move(staged, moved)  # as after wandb's staging area was cleaned
    try:
        s = offline_run_summary(run_dir)
        assert Path(s["ledger_file"]) == copy and s["ledger"].steps == 5
    finally:
        shutil.move(moved, staged)


def test_a_directory_without_an_offline_run_says_where_it_looked(tmp_path, capsys):
    from lightning_dpzero.cli import main

    assert main(["wandb-summary", str(tmp_path)]) == 1
    assert "no offline W&B run here" in capsys.readouterr().err
