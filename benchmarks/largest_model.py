"""The widest GPT that trains one step within a per-process memory budget, non-DP against DP, per ZeRO stage.

DP-ZeRO should train what ZeRO trains: for each ZeRO stage (and ZeRO-3 with optimizer and parameter
offload), search the largest width d of a GPT-style decoder (``benchmarks.models``, ``--layers`` blocks,
head size 32, vocab 256, T ``--seq``, micro-batch ``--batch`` per process, ``--world`` processes, Adam, fp32)
for which one optimizer step completes with every process's peak RSS within ``--budget-mb``, first without
DP (Lightning's DeepSpeedStrategy), then with DPDeepSpeedStrategy layer-wise and all-layer clipping.

Fitting is decided by measurement: a trial fits when it exits cleanly and each rank's RSS high-water mark
(``VmHWM``, libraries included) and the watchdog's samples of ``VmRSS`` stay within the budget; the
watchdog (``benchmarks.launch``) kills a trial as soon as one process crosses it, so the search never takes
more than ``world × budget`` of the machine. The search is placed by the ZeRO formula: the first width
tried is the one whose model states (fp32 Adam: 4Ψ parameters + 4Ψ gradients + 8Ψ optimizer states,
partitioned per stage) fill the budget left after the library footprint measured by a tiny trial; then
it brackets and bisects on multiples of 32. A DP search starts at non-DP's width and steps by 32.

Usage::

    python -m benchmarks.largest_model                      # budget 2048 MB per process, ~40 trials, ~55 min shared
    python -m benchmarks.largest_model --stages 3 --budget-mb 1536
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from benchmarks.common import LARGEST_DP_METHODS, RESULTS, close_run, machine_info, md_table, write_json
from benchmarks.launch import launch
from benchmarks.step_time import METHODS, lightning_case

HEAD, STEP = 32, 32  # head size and width granularity


def psi_of(d: int, args) -> int:
    """Parameters of the decoder at width d, counted from its layers (the model is not built: at the widths
    searched it would take a process's whole budget): per block two LayerNorms, q/k/v/o and a 4× MLP."""
    V, T, L = 256, args.seq, args.layers
    block = 2 * 2 * d + 4 * (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return V * d + T * d + L * block + 2 * d + d * V + V


def model_kw(d: int, args) -> dict:
    return dict(vocab=256, d_model=d, heads=d // HEAD, layers=args.layers, seq=args.seq)


def bytes_per_param(stage: int, world: int) -> float:
    """fp32 Adam model-state bytes per parameter on one rank: 4 (params) + 4 (grads) + 8 (Adam's two
    moments), partitioned over ``world`` ranks as the ZeRO paper's stages do; offloaded states still count
    (on a CPU machine they stay in the same memory)."""
    p, g, o = 4.0, 4.0, 8.0
    return p / (world if stage >= 3 else 1) + g / (world if stage >= 2 else 1) + o / (world if stage >= 1 else 1)


def predicted_width(stage: int, args, base_mb: float) -> int:
    """The width whose model states fill the budget left after the library footprint (24·d² + 2·256·d
    parameters per two-block decoder: solved on the real count by stepping)."""
    room = (args.budget_mb - base_mb) * 2**20 / bytes_per_param(stage, args.world)
    d = STEP
    while psi_of(d + STEP, args) <= room:
        d += STEP
    return max(d, STEP)


def trial_config(args, label: str, stage: int, method: str, d: int, offload: bool) -> dict:
    """The worker configuration of one trial: one optimizer step of width ``d`` and nothing after it (no
    profiled memory step: its records and a second step would count in the peak RSS that decides the fit)."""
    kw = dict(METHODS[method])
    if offload:
        # torch's Adam on the offloaded states: the CPU is the device here (DeepSpeedCPUAdam would need
        # its C++ op built), so DeepSpeed's check for its own CPU optimizer is turned off
        kw["strategy_kw"] = dict(offload_optimizer=True, offload_parameters=True)
        kw["ds_config"] = {"zero_force_ds_cpu_optimizer": False}
    return lightning_case(f"{label}/d{d}", method, model="gpt", model_kw=model_kw(d, args), stage=stage,
                          world=args.world, batch=args.batch, warmup=0, steps=1, memory_step=False,
                          default_malloc=True, **kw)


class Search:
    def __init__(self, args, logdir: Path, res: dict):
        self.args, self.logdir, self.res = args, logdir, res

    def trial(self, label: str, stage: int, method: str, d: int, offload: bool) -> dict:
        cfg = trial_config(self.args, label, stage, method, d, offload)
        r = launch(cfg, self.logdir, self.args.timeout, rss_limit_mb=self.args.budget_mb)
        peak = max(r.get("rss_peak_mb") or [0.0])
        seen = max(r.get("rss_seen_mb") or [0.0])
        fits = "error" not in r and max(peak, seen) <= self.args.budget_mb
        t = {"config": label, "method": method, "stage": stage, "offload": offload, "d": d,
             "psi": psi_of(d, self.args), "fits": fits, "peak_rss_mb": peak or None, "rss_seen_mb": seen,
             "model_states": r.get("model_states"), "error": r.get("error"), "wall_s": r.get("launch_wall_s")}
        if "error" in r and not r.get("over_budget"):
            t["log_tail"] = r.get("log_tail", "")[-800:]
        self.res["trials"].append(t)
        write_json(self.args.out, self.res)
        print(f"{label:12s} {method:6s} d {d:5d} Ψ {t['psi'] / 1e6:7.1f} M  "
              f"{'fits' if fits else 'no  '}  peak {max(peak, seen):6.0f} MB  {r.get('error') or ''}", flush=True)
        return t

    def largest(self, label, stage, method, start: int, grow: float, offload=False) -> dict | None:
        """Largest fitting multiple of STEP: bracket from ``start`` (×``grow``, at least ±STEP; faster after two
        steps the same way), then bisect. None when nothing fits, or a tiny model fails for another reason."""
        fit, nofit, k = None, None, start // STEP
        best, misses, hits = None, 0, 0
        for _ in range(20):
            t = self.trial(label, stage, method, k * STEP, offload)
            if t["fits"]:
                fit, best = k, t
            else:
                nofit = k
                if t["error"] and "over the memory budget" not in t["error"] and t["peak_rss_mb"] is None \
                        and "out of memory" not in (t.get("log_tail") or "").lower() and fit is None and k <= 4:
                    return None  # it fails for another reason even when tiny: not a memory limit
            if fit is not None and nofit is not None and nofit - fit <= 1:
                return best
            if nofit is None:  # everything fits so far: step up, faster after two hits
                hits += 1
                k = max(k + 1, math.ceil(k * (grow if hits <= 2 else 1.25)))
            elif fit is None:  # nothing fits yet: step down, faster after two misses (a formula far off)
                misses += 1
                k = max(1, min(k - 1, math.floor(k / (grow if misses <= 2 else 1.25))))
            else:
                k = (fit + nofit) // 2
        return best


def render(res: dict) -> str:
    methods = [m for m in LARGEST_DP_METHODS if any(m in c["results"] for c in res["configs"])]
    rows = []
    for c in res["configs"]:
        nd = c["results"].get("nondp")
        row = [c["label"], f"{res['args']['budget_mb']:.0f}", c["predicted_d"],
               f"{c['formula_psi'] / 1e6:.1f} M"]
        if not nd:
            rows.append(row + ["not found"] + [None] * (2 * len(methods) + 1))
            continue
        row += [f"{nd['d']} / {nd['psi'] / 1e6:.1f} M / {nd['peak_rss_mb']:.0f}"]
        for m in methods:
            r = c["results"].get(m)
            row += [f"{r['d']} / {r['psi'] / 1e6:.1f} M / {r['peak_rss_mb']:.0f}" if r else "not found",
                    f"{r['psi'] / nd['psi']:.3f}" if r else None]
        states = nd["psi"] * bytes_per_param(c["stage"], res["args"]["world"]) / 2**20
        row.append(f"{states:.0f} + {res['footprint_mb']:.0f} = {states + res['footprint_mb']:.0f}")
        rows.append(row)
    heads = [h for m in methods for h in (f"{LARGEST_DP_METHODS[m]}: d / Ψ / peak RSS MB", "Ψ ÷ non-DP")]
    return md_table(["ZeRO", "budget MB/proc", "formula's d", "formula's Ψ", "non-DP: d / Ψ / peak RSS MB", *heads,
                     "formula's model states at non-DP's Ψ + footprint, MB/proc"], rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-mb", type=float, default=2048, help="peak RSS allowed per process (MB)")
    ap.add_argument("--stages", default="0,1,2,3,3o", help="ZeRO stages; 3o: ZeRO-3 with CPU offload")
    ap.add_argument("--methods", default="nondp,layer,all",
                    help="nondp and the DP methods: layer, all, all-2pass (all-layer, two-pass)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="micro-batch per process")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=str(RESULTS / "largest_model_cpu.json"))
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    res = {"args": vars(args), "machine_before": machine_info(), "configs": [], "trials": []}
    search = Search(args, Path(tempfile.mkdtemp(prefix="dpzero-largest-")), res)
    t0 = time.time()
    tiny = search.trial("footprint", 0, "nondp", 2 * STEP, False)
    base = tiny["peak_rss_mb"] or 600.0
    res["footprint_mb"] = base
    for spec in args.stages.split(","):
        stage, offload = int(spec[0]), spec.endswith("o")
        label = f"ZeRO-{stage}" + (" + offload" if offload else "")
        d0 = predicted_width(stage, args, base)
        c = {"label": label, "stage": stage, "offload": offload, "predicted_d": d0,
             "formula_psi": psi_of(d0, args), "results": {}}
        res["configs"].append(c)
        nd = search.largest(label, stage, "nondp", d0, 1.08, offload) if "nondp" in methods else None
        c["results"]["nondp"] = nd
        for m in (m for m in methods if m != "nondp"):
            c["results"][m] = search.largest(label, stage, m, nd["d"] if nd else d0, 1.0, offload)
        write_json(args.out, res)
    close_run(res, args.out, t0)
    print(render(res))
    return res


if __name__ == "__main__":
    main()
