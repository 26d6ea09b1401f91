"""How the cost of DP grows with width, sequence length and batch: GPT step time and peak memory on ZeRO-3.

A grid of GPT-style decoders (``benchmarks.models``, ``--layers`` blocks, d/64 heads, vocab 256): width d in
``--widths``, sequence length T in ``--seqs``, micro-batch B per process in ``--batches``; for each, the
non-DP baseline (Lightning's DeepSpeedStrategy) and DPDeepSpeedStrategy with layer-wise and all-layer
clipping (Abadi, σ = 1, C = 1), ZeRO-3, ``--world`` processes, one launch per configuration, ``--warmup``
untimed steps then ``--steps`` timed steps (the same measurement as ``benchmarks.step_time``: CPU time per
step summed over the ranks, peak RSS per process). A watchdog kills a configuration whose RSS crosses
``--rss-limit-mb`` in one process (recorded as over the budget), so the grid cannot exhaust a shared machine.

Usage::

    python -m benchmarks.scaling                 # the default grid (16 min predicted, 45 min on 2 shared cores)
    python -m benchmarks.scaling --estimate      # the predicted run time of the grid, without running it
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, close_run, machine_info, md_table, write_json
from benchmarks.launch import launch
from benchmarks.step_time import METHODS, finish, lightning_case

#: CPU FLOP/s of one core measured by the step-time run (GPT d 256, ZeRO-3 non-DP: ~60 GFLOP/s), the
#: DP/non-DP factor assumed for the estimate, and a launch's fixed cost (interpreter, DeepSpeed set-up)
FLOPS_PER_CORE, DP_FACTOR, LAUNCH_S = 60e9, 1.3, 20.0


def grid(args) -> list[dict]:
    cases = []
    for d, T, B in itertools.product(args.widths, args.seqs, args.batches):
        kw = dict(vocab=256, d_model=d, heads=max(1, d // 64), layers=args.layers, seq=T)
        for method in ("nondp", "layer", "all"):
            cases.append(lightning_case(f"d{d}/T{T}/B{B}", method, model="gpt", model_kw=kw, stage=args.stage,
                                        world=args.world, batch=B, warmup=args.warmup, steps=args.steps,
                                        memory_step=False, **METHODS[method]))  # peak RSS of training steps only
    return cases


def step_flops(kw: dict, batch: int) -> float:
    """Forward + backward FLOPs of one micro-batch (6 per weight per token, plus attention scores)."""
    d, T, L = kw["d_model"], kw["seq"], kw["layers"]
    weights = L * 12 * d * d + kw["vocab"] * d
    return 6.0 * weights * batch * T + 3.0 * 4 * batch * T * T * d * L


def estimate_s(cases: list[dict]) -> float:
    """Predicted wall seconds of the grid with one core per rank."""
    total = 0.0
    for c in cases:
        per_step = step_flops(c["model_kw"], c["batch"]) / FLOPS_PER_CORE * (1 if c["method"] == "nondp" else DP_FACTOR)
        total += LAUNCH_S + (c["warmup"] + c["steps"]) * per_step
    return total


def render(res: dict) -> str:
    """One row per shape: non-DP CPU ms and peak RSS, then each DP method's ratios."""
    by = {r["name"]: r for r in res["results"]}
    rows = []
    for group in dict.fromkeys(r["group"] for r in res["results"]):
        base = by.get(f"{group}/nondp", {})
        d, T, B = (int(x[1:]) for x in group.split("/"))
        row = [d, T, B]
        if "error" in base:
            rows.append(row + ["over the memory budget" if base.get("over_budget") else "failed"] + [None] * 6)
            continue
        row += [1e3 * base["cpu_median_s"], max(base["rss_peak_mb"])]
        for m in ("layer", "all"):
            r = by.get(f"{group}/{m}", {})
            if not r:
                row += [None, None]  # not run (an interrupted grid)
            elif "error" in r:
                row += ["over budget" if r.get("over_budget") else "failed", None]
            else:
                row += [r.get("cpu_ratio"), r.get("rss_peak_ratio")]
        rows.append(row)
    return md_table(["d", "T", "B", "non-DP CPU ms/step (Σ procs)", "non-DP peak RSS MB/proc",
                     "layer-wise × time", "layer-wise × peak RSS", "all-layer × time", "all-layer × peak RSS"],
                    rows)


def main(argv=None) -> dict:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=ints, default=[256, 768])
    ap.add_argument("--seqs", type=ints, default=[128, 512])
    ap.add_argument("--batches", type=ints, default=[8, 32])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rss-limit-mb", type=float, default=5120, help="watchdog: per-process RSS budget")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per configuration")
    ap.add_argument("--estimate", action="store_true", help="print the predicted run time and exit")
    ap.add_argument("--out", default=str(RESULTS / "scaling_cpu.json"))
    args = ap.parse_args(argv)
    cases = grid(args)
    est = estimate_s(cases)
    print(f"{len(cases)} configurations, predicted {est / 60:.0f} min with a free core per process", flush=True)
    if args.estimate:
        return {}
    logdir = Path(tempfile.mkdtemp(prefix="dpzero-scaling-"))
    res = {"args": vars(args), "machine_before": machine_info(), "estimate_s": est, "results": []}
    t0 = time.time()
    for cfg in cases:
        r = launch(cfg, logdir, args.timeout, rss_limit_mb=args.rss_limit_mb)
        r.update({k: cfg[k] for k in ("name", "group", "baseline", "kind", "model", "method", "world", "batch",
                                      "stage", "model_kw")})
        res["results"].append(r)
        finish(res["results"], cases)
        print(cfg["name"], r.get("error") or f"CPU {1e3 * r['cpu_median_s']:.0f} ms ×{r.get('cpu_ratio', 1):.3f} "
              f"peak RSS {max(r['rss_peak_mb']):.0f} MB ({r['launch_wall_s']:.0f} s)", flush=True)
        write_json(args.out, res)  # partial results survive an interrupted grid
    close_run(res, args.out, t0)
    print(render(res))
    return res


if __name__ == "__main__":
    main()
