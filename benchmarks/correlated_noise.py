"""Accuracy at equal ε: DP-SGD against correlated noise (``noise_mechanism="banded-mf"``, later others) on the
digits CNN (examples/digits.py: 1,500 training images, 20 epochs, batch 128, one process, ZeRO-0, σ calibrated
to each ε at δ = 1e-5), each row the mean of ``--seeds`` seeds (initial weights, noise and sampling).

Each run is a subprocess of ``examples/digits.py``; its last line ``accuracy=A epsilon=E`` is parsed. Results are
merged into ``benchmarks/results/correlated_noise.json`` (``--out``) after every run, keyed by (ε, mechanism,
seed): rerunning some rows (say a new mechanism) keeps the others. A Markdown table of the whole file is printed.

A mechanism is ``dp-sgd`` or ``NAME:K`` (``noise_mechanism=NAME, bands=K``), e.g. ``banded-mf:4``.
:func:`sweep` is shared with ``benchmarks/correlated_noise_minilm.py``.

Usage::

    python -m benchmarks.correlated_noise [--epsilons 1 2 8] [--mechanisms dp-sgd banded-mf:4 banded-mf:8]
                                          [--seeds 3] [--epochs 20]
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
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "correlated_noise.json"
DEFAULT_MECHANISMS = ["dp-sgd", "banded-mf:4", "banded-mf:8"]


def parse_mechanism(spec: str) -> tuple[str, Optional[int]]:
    """``"dp-sgd"`` -> ("dp-sgd", None); ``"banded-mf:4"`` -> ("banded-mf", 4).

    Raises:
        ValueError: not ``dp-sgd`` nor ``NAME:K`` with a positive integer K.
    """
    if spec == "dp-sgd":
        return spec, None
    name, sep, k = spec.partition(":")
    if not sep or not name or not k.isdigit() or int(k) < 1:
        raise ValueError(f"mechanism {spec!r}: use 'dp-sgd' or NAME:K with K a positive integer, e.g. banded-mf:4")
    return name, int(k)


def run_subprocess(cmd: list[str], line: str) -> tuple[re.Match, str]:
    """Runs ``cmd`` (warnings off); returns the match of the regex ``line`` in its stdout, and all its output.

    Raises:
        RuntimeError: the run failed or printed no such line (with the end of its output).
    """
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    found = re.search(line, out.stdout)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode} without {line!r}:\n"
                           f"{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return found, out.stdout + out.stderr


def sigma_of(output: str) -> Optional[float]:
    """σ from the accountant's plan line (``sigma=S``) of a run's output."""
    found = re.search(r"sigma=([\d.]+)", output)
    return float(found.group(1)) if found else None


def run_digits(epsilon: float, seed: int, noise_mechanism: str, bands: Optional[int], epochs: int) -> dict:
    """One examples/digits.py run: {accuracy, epsilon, sigma}."""
    cmd = [sys.executable, str(ROOT / "examples" / "digits.py"), "--devices", "1", "--stage", "0",
           "--checkpoint", "", "--epochs", str(epochs), "--target-epsilon", str(epsilon), "--seed", str(seed),
           "--noise-seed", str(seed), "--noise-mechanism", noise_mechanism]
    if bands is not None:
        cmd += ["--bands", str(bands)]
    found, output = run_subprocess(cmd, r"accuracy=([\d.]+) epsilon=([\d.]+)")
    return {"accuracy": float(found.group(1)), "epsilon": float(found.group(2)), "sigma": sigma_of(output)}


def _row_summary(row: dict) -> None:
    accs = [r["accuracy"] for r in row["runs"]]
    row["accuracy_mean"] = statistics.mean(accs)
    row["accuracy_std"] = statistics.pstdev(accs)  # population sd of the seeds, as in the published tables
    row["sigma"] = row["runs"][0]["sigma"]


def _load(out: Path, header: dict) -> dict:
    if not out.exists():
        return {**header, "rows": []}
    result = json.loads(out.read_text())
    old = {k: result.get(k) for k in header}
    if old != header:
        raise ValueError(f"{out} holds runs of another setting ({old}) than this one ({header}); pass another "
                         "--out, or the same setting, to add runs to it.")
    return result


def sweep(run: Callable[..., dict], epsilons: list[float], mechanisms: list[str], seeds: int, out: Path,
          header: dict, redo: bool = False) -> dict:
    """Runs ``run(epsilon, seed, noise_mechanism, bands)`` for every seed 0..seeds-1, ε and mechanism, merging each
    result into ``out`` (JSON) as it comes: rows keyed by (ε, mechanism), runs within a row by seed, so a rerun of
    some keeps all the others. A (ε, mechanism, seed) already in the file is skipped unless ``redo`` (so a sweep cut
    short resumes). ``header`` (benchmark, model, setting) must match the file's; returns the file's content.
    Prints one line per run and the Markdown table of all rows at the end."""
    parsed = [(spec, *parse_mechanism(spec)) for spec in mechanisms]  # bad specs fail before any run
    result = _load(out, header)
    # seed outermost: a sweep cut short still has every (ε, mechanism) cell, with fewer seeds
    for seed in range(seeds):
        for eps in epsilons:
            for spec, name, bands in parsed:
                row = next((r for r in result["rows"] if r["target_epsilon"] == eps and r["mechanism"] == spec), None)
                if row is not None and not redo and any(r["seed"] == seed for r in row["runs"]):
                    continue
                got = {"seed": seed, **run(eps, seed, name, bands)}
                if row is None:
                    row = {"target_epsilon": eps, "mechanism": spec, "noise_mechanism": name, "bands": bands,
                           "runs": []}
                    result["rows"].append(row)
                row["runs"] = sorted([r for r in row["runs"] if r["seed"] != seed] + [got], key=lambda r: r["seed"])
                _row_summary(row)
                result["rows"].sort(key=lambda r: (r["target_epsilon"], r["noise_mechanism"] != "dp-sgd",
                                                   r["noise_mechanism"], r["bands"] or 0))
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=2) + "\n")
                print(f"eps={eps:g} {spec} seed={seed}: " + " ".join(f"{k}={v}" for k, v in got.items()), flush=True)
    print(markdown_table(result))
    return result


def markdown_table(result: dict) -> str:
    lines = ["| ε | mechanism | σ | test accuracy (mean ± sd) | seeds |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        sigma = f"{r['sigma']:.3g}" if r["sigma"] is not None else "?"
        lines.append(f"| {r['target_epsilon']:g} | {r['mechanism']} | {sigma} | "
                     f"{r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f} | {len(r['runs'])} |")
    return "\n".join(lines)


def add_sweep_arguments(ap: argparse.ArgumentParser, out: Path) -> argparse.ArgumentParser:
    """--epsilons, --mechanisms, --seeds, --out (shared by the correlated-noise accuracy benchmarks)."""
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 8.0])
    ap.add_argument("--mechanisms", nargs="+", default=DEFAULT_MECHANISMS,
                    help="dp-sgd or NAME:K (noise_mechanism=NAME, bands=K), e.g. dp-sgd banded-mf:4")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..seeds-1 (weights, noise and sampling)")
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--redo", action="store_true", help="rerun the runs --out already holds (default: skip them)")
    return ap


def main(argv=None) -> dict:
    ap = add_sweep_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), OUT)
    ap.add_argument("--epochs", type=int, default=20)
    args = ap.parse_args(argv)
    header = {"benchmark": "correlated_noise", "model": "digits CNN (examples/digits.py)",
              "setting": {"epochs": args.epochs, "batch_size": 128, "devices": 1, "stage": 0, "delta": 1e-5}}
    return sweep(lambda eps, seed, name, bands: run_digits(eps, seed, name, bands, args.epochs),
                 args.epsilons, args.mechanisms, args.seeds, args.out, header, args.redo)


if __name__ == "__main__":
    main()
