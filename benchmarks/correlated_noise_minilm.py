"""Accuracy at equal ε: DP-SGD against correlated noise on the MiniLM LoRA example (examples/minilm_lora.py, its
config examples/configs/minilm_lora.yaml), made small enough for a shared CPU: one process, ZeRO-0, the first
``--train-size`` lines of the training split (512 of 3,260), ``--max-length`` 16 tokens (95.6% of the lines fit),
expected batch 64 (q = 0.125, 8 steps per epoch, so b ≤ 8), ``--epochs`` 3 (24 steps), validation on all 575
held-out lines at the end. σ is calibrated to each ε at δ = 1e-5; each row is the mean of ``--seeds`` seeds
(``seed_everything`` and the strategy's noise and sampling seed).

Each run is a subprocess of ``examples/minilm_lora.py`` with CLI overrides and a small override config (the
accountant's ``target_epsilon``; no checkpoint); its last line ``accuracy=A majority=M epsilon=E ...`` is parsed.
Results are merged into ``benchmarks/results/correlated_noise_minilm.json`` (``--out``) by
:func:`benchmarks.correlated_noise.sweep`, keyed by (ε, mechanism, seed).

Needs the ``lora`` extra (``pip install -c constraints-cpu.txt -e ".[lora]"``). About 3–5 minutes a run on a
shared 2-core CPU.

Usage::

    python -m benchmarks.correlated_noise_minilm [--epsilons 1 2 8] [--mechanisms dp-sgd banded-mf:4]
                                                 [--seeds 3] [--epochs 3] [--train-size 512]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Optional

import yaml

from benchmarks.correlated_noise import ROOT, add_sweep_arguments, run_subprocess, sigma_of, sweep

OUT = ROOT / "benchmarks" / "results" / "correlated_noise_minilm.json"
CONFIG = ROOT / "examples" / "configs" / "minilm_lora.yaml"


def override_config(epsilon: float) -> dict:
    """The example's callbacks with the accountant's ``target_epsilon`` set and the checkpoint dropped."""
    callbacks = []
    for cb in yaml.safe_load(CONFIG.read_text())["trainer"]["callbacks"]:
        if cb["class_path"].endswith("ModelCheckpoint"):
            continue
        if cb["class_path"].endswith("PrivacyAccountantCallback"):
            cb = {**cb, "init_args": {**cb["init_args"], "target_epsilon": epsilon}}
        callbacks.append(cb)
    return {"trainer": {"enable_checkpointing": False, "callbacks": callbacks}}


def run_minilm(epsilon: float, seed: int, noise_mechanism: str, bands: Optional[int], setting: dict) -> dict:
    """One examples/minilm_lora.py run: {accuracy, majority, epsilon, sigma, wall_time}."""
    steps = setting["epochs"] * setting["train_size"] // setting["batch_size"]
    with tempfile.TemporaryDirectory(prefix="correlated_noise_minilm_") as tmp:
        config = Path(tmp) / "override.yaml"
        config.write_text(yaml.safe_dump(override_config(epsilon)))
        strategy = "--trainer.strategy.init_args."
        cmd = [sys.executable, str(ROOT / "examples" / "minilm_lora.py"), "--config", str(config),
               "--trainer.devices=1", f"{strategy}stage={setting['stage']}", f"{strategy}seed={seed}",
               f"{strategy}noise_mechanism={noise_mechanism}", f"--seed_everything={seed}",
               f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}",
               f"--data.batch_size={setting['batch_size']}", f"--data.max_length={setting['max_length']}",
               f"--data.train_size={setting['train_size']}", f"--trainer.logger.init_args.save_dir={tmp}",
               "--trainer.enable_progress_bar=false"]
        if bands is not None:
            cmd.append(f"{strategy}bands={bands}")
        found, output = run_subprocess(cmd, r"accuracy=([\d.]+) majority=([\d.]+) epsilon=([\d.]+) .*"
                                            r"wall_time=([\d.]+)s")
    return {"accuracy": float(found.group(1)), "majority": float(found.group(2)), "epsilon": float(found.group(3)),
            "sigma": sigma_of(output), "wall_time_s": float(found.group(4))}


def main(argv=None) -> dict:
    ap = add_sweep_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), OUT)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--train-size", type=int, default=512, help="training lines (of 3,260)")
    ap.add_argument("--batch-size", type=int, default=64, help="expected batch")
    ap.add_argument("--max-length", type=int, default=16, help="tokens per line")
    args = ap.parse_args(argv)
    setting = {"epochs": args.epochs, "train_size": args.train_size, "batch_size": args.batch_size,
               "max_length": args.max_length, "devices": 1, "stage": 0, "delta": 1e-5}
    header = {"benchmark": "correlated_noise_minilm",
              "model": "all-MiniLM-L6-v2 + LoRA r=8 (examples/minilm_lora.py)", "setting": setting}
    return sweep(lambda eps, seed, name, bands: run_minilm(eps, seed, name, bands, setting),
                 args.epsilons, args.mechanisms, args.seeds, args.out, header, args.redo)


if __name__ == "__main__":
    main()
