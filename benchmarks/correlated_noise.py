"""Accuracy at equal ε: DP-SGD against banded matrix factorization (``noise_mechanism="banded-mf"``) on the digits
CNN (examples/digits.py: 1,500 training images, 20 epochs, batch 128, one process, ZeRO-0, σ calibrated to each
ε at δ = 1e-5), each row the mean of ``--seeds`` seeds (initial weights and noise).

Each run is a subprocess of ``examples/digits.py``; its last line ``accuracy=A epsilon=E`` is parsed. Results go
to ``benchmarks/results/correlated_noise.json`` (``--out``) and a Markdown table is printed.

Usage::

    python -m benchmarks.correlated_noise [--epsilons 1 2 8] [--bands 4 8] [--seeds 3] [--epochs 20]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "correlated_noise.json"


def run_digits(epsilon: float, seed: int, epochs: int, bands: int | None) -> dict:
    """One examples/digits.py run; ``bands`` None: DP-SGD."""
    cmd = [sys.executable, str(ROOT / "examples" / "digits.py"), "--devices", "1", "--stage", "0",
           "--checkpoint", "", "--epochs", str(epochs), "--target-epsilon", str(epsilon), "--seed", str(seed),
           "--noise-seed", str(seed)]
    if bands is not None:
        cmd += ["--noise-mechanism", "banded-mf", "--bands", str(bands)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    found = re.search(r"accuracy=([\d.]+) epsilon=([\d.]+)", out.stdout)
    sigma = re.search(r"sigma=([\d.]+)", out.stdout)
    return {"accuracy": float(found.group(1)), "epsilon": float(found.group(2)),
            "sigma": float(sigma.group(1)) if sigma else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 8.0])
    ap.add_argument("--bands", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    rows = []
    for eps in args.epsilons:
        for bands in [None, *args.bands]:
            runs = [run_digits(eps, seed, args.epochs, bands) for seed in range(args.seeds)]
            rows.append({"target_epsilon": eps, "mechanism": "dp-sgd" if bands is None else f"banded-mf b={bands}",
                         "accuracy_mean": statistics.mean(r["accuracy"] for r in runs),
                         "accuracy_std": statistics.pstdev(r["accuracy"] for r in runs),
                         "sigma": runs[0]["sigma"], "runs": runs})
            print(rows[-1]["target_epsilon"], rows[-1]["mechanism"], f"{rows[-1]['accuracy_mean']:.3f}", flush=True)
    result = {"benchmark": "correlated_noise", "model": "digits CNN (examples/digits.py)", "epochs": args.epochs,
              "seeds": args.seeds, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("| ε | mechanism | σ | test accuracy (mean ± sd) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['target_epsilon']:g} | {r['mechanism']} | {r['sigma']:.3g} | "
              f"{r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f} |")
    return result


if __name__ == "__main__":
    main()
