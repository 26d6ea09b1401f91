"""Accuracy and cost of the package's epsilon against tests/data/epsilon_references.json.

For every reference setting: the package's ``compute_epsilon`` (and the time to choose its grid and to
evaluate it), dp-accounting's PLD on the previous fixed grid of 1e-3 nats, the tightest reference bound
(min of dp-accounting's PLD over grids and RDP) and Opacus' PRV bracket. Prints a Markdown table and the
worst cases, and with ``--out`` writes them as JSON (``benchmarks.run`` shows its verdict row)::

    python benchmarks/epsilon_accuracy.py [--references tests/data/epsilon_references.json] [--no-fixed]
        [--out benchmarks/results/epsilon_accuracy.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import dp_accounting

from lightning_dpzero.accounting import LedgerEntry, epsilon_bound
from lightning_dpzero.accounting import pld as engine

ROOT = Path(__file__).resolve().parents[1]


def fixed_grid(q, sigma, steps, delta, h=1e-3):
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=h)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    return acc.get_epsilon(delta)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--references", default=str(ROOT / "tests" / "data" / "epsilon_references.json"))
    p.add_argument("--no-fixed", action="store_true", help="skip the fixed 1e-3 grid column (slow at 1e6 steps)")
    p.add_argument("--out", default=None, help="write the rows and the worst cases as JSON here")
    a = p.parse_args(argv)
    rows = json.loads(Path(a.references).read_text())["settings"]
    print("| q | σ | steps | δ | ours | tightest ref. | PRV bracket | ours / tightest | fixed 1e-3 grid | grid s | ε s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    worst, worst_small, grid_max, eval_max = (0.0, None), 0.0, 0.0, 0.0
    out_rows, t_start = [], time.time()
    for r in rows:
        q, s, n, d = r["sample_rate"], r["noise_multiplier"], r["steps"], r["delta"]
        t0 = time.process_time()
        engine.grid_interval(q, s, d)
        t_grid = time.process_time() - t0
        t0 = time.process_time()
        eps = epsilon_bound([LedgerEntry(q, s, n)], d).epsilon
        t_eval = time.process_time() - t0
        tight = min(r["pld"], r["rdp"])
        old = "–" if a.no_fixed or n > 100_000 else f"{fixed_grid(q, s, n, d):.4g}"
        prv = r.get("prv")
        ratio = eps / tight if tight > 0 else 1.0
        if tight >= 0.01 and ratio - 1 > worst[0]:
            worst = (ratio - 1, (q, s, n, d))
        if tight < 0.01:
            worst_small = max(worst_small, eps - tight)
        grid_max, eval_max = max(grid_max, t_grid), max(eval_max, t_eval)
        prv_text = f"[{prv[0]:.5g}, {prv[2]:.5g}]" if prv else "–"
        out_rows.append({"sample_rate": q, "noise_multiplier": s, "steps": n, "delta": d, "epsilon": eps,
                         "tightest": tight, "prv": prv, "ratio": ratio, "grid_s": t_grid, "epsilon_s": t_eval})
        print(f"| {q:g} | {s:g} | {n} | {d:g} | {eps:.5g} | {tight:.5g} | {prv_text} | {ratio:.4f} | {old} | "
              f"{t_grid:.2f} | {t_eval:.2f} |", flush=True)
    print(f"\nworst relative excess where eps >= 0.01: {100 * worst[0]:.3f} % at {worst[1]}; worst absolute excess "
          f"below 0.01: {worst_small:.2e}; grid choice <= {grid_max:.2f} s, one epsilon <= {eval_max:.2f} s of CPU "
          f"(load average {os.getloadavg()[0]:.1f})")
    if a.out:
        Path(a.out).write_text(json.dumps({
            "references": os.path.relpath(a.references, ROOT), "settings": len(rows), "rows": out_rows,
            "worst_relative_excess": worst[0], "worst_setting": worst[1], "worst_absolute_excess_below_0.01": worst_small,
            "grid_s_max": grid_max, "epsilon_s_max": eval_max, "wall_s": time.time() - t_start}, indent=1) + "\n")


if __name__ == "__main__":
    main()
