"""W&B offline logging of a DP run, read back from the run's transaction log (``run-<id>.wandb``).

The example runs as a subprocess through the CLI (Lightning relaunches the running command for rank 1, so
it must not be pytest): the Shakespeare GPT, shrunk, 5 steps, with ``examples/configs/wandb.yaml``
(``WandbLogger(offline=True)``). wandb 0.31 ships no Python reader for its offline files, so
:func:`read_records` parses the file's framing (LevelDB log format: 32 KiB blocks of records, each a
7-byte header ``crc32 | length | type`` then data; a record longer than a block is split into
FIRST/MIDDLE/LAST pieces) and decodes each record with wandb's own protobuf classes (``wandb.proto``).
"""

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("wandb")

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path):
    """Yield the ``wandb_internal_pb2.Record`` messages of an offline run file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    assert ident == b":W&B", f"{path} is not a W&B transaction log"
    pos, pieces = _HEADER, []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (_FULL, _FIRST):
            pieces = [chunk]
        else:
            pieces.append(chunk)
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(pieces))
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(run_file):
    """{history: [dict per logged row], config: {key: value}, summary: {...}, artifacts: [ArtifactRecord]}."""
    history, config, summary, artifacts = [], {}, {}, []
    for r in read_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "config":
            config.update({_key(i): json.loads(i.value_json) for i in r.config.update})
        elif kind == "run":
            config.update({_key(i): json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in r.summary.update})
        elif kind == "artifact":
            artifacts.append(r.artifact)
    return {"history": history, "config": config, "summary": summary, "artifacts": artifacts}


def series(history, key):
    return [row[key] for row in history if key in row]


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
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
    return read_run(files[0]), proc.stdout


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
