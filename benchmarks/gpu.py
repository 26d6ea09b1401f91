"""The prepared one-GPU run: step-time cases at GPT-2-small width (d 768) and the batch-128 naive-loop speed-up.

Sized for one H200 in under 8 minutes: no configuration starts after ``--budget-s`` (360 s) and each has
``--timeout`` (120 s); those left are listed as skipped. Installs nothing from the network: Python packages the machine lacks
(DeepSpeed, dp-accounting, Opacus, ...) come from wheels carried in ``.whl/`` (see ``benchmarks/gpu.sh``);
a configuration whose packages are missing fails alone and is reported, the others still run.

Configurations (one process launch each, ``benchmarks.step_time`` workers):

* Lightning + DeepSpeed on 1 GPU, micro-batch ``--batch`` (default 32), ``--precision`` (default
  bf16-mixed): non-DP and DP layer-wise / all-layer at ZeRO-0 and ZeRO-3, group-wise and automatic
  clipping at ZeRO-3, LoRA DP vs non-DP; and ZeRO-3 in fp16 (DeepSpeed's loss-scaled ``16-mixed``);
* one process, batch ``--single-batch`` (default 128), fp32 with TF32 matmuls: non-DP, ours (layer-wise,
  all-layer), Opacus hooks and ghost, torch.func, and the naive per-example loop: the speed-up of our
  engine over the naive loop at batch 128 is printed last;
* then, while the budget lasts, ``--profile`` (default: ZeRO-3 non-DP, layer-wise and all-layer) once more
  under torch.profiler, host and GPU: each step's host time against the GPU's busy time and kernel count,
  and the engine's labels (``res["profiles"]``; the page's *Where the step's time goes*).

With ``--full``, the full-size configurations instead (each DP case against the non-DP run of the same
model, precision and ZeRO stage, launched the same way; ``cuda_peak``: each run's peak GPU memory), bf16-mixed
ZeRO-3, micro-batch 8, T 1024: GPT-2 small (12 blocks, d 768, 12 heads, vocabulary 50257) non-DP, layer-wise
and all-layer; a Llama-style 1B (22 blocks, d 2048, 32 query and 4 key/value heads, SwiGLU 5632, RMSNorm,
vocabulary 32000, learned positions) with every parameter trained, the same three; and that model with LoRA
(rank 8 on q and v) non-DP and layer-wise. Sized for a 10-minute device call (``--budget-s`` 480,
``--timeout`` 240 per configuration); ``--full --smoke`` runs the same families at tiny sizes on the CPU.

Writes ``$OUT/step_time_gpu.json`` (or ``--out``) and prints the table last.

Usage::

    bash benchmarks/gpu.sh               # on the GPU machine
    bash benchmarks/gpu.sh --smoke       # on the CPU: tiny model, same code paths, a few minutes
    bash benchmarks/gpu.sh --full        # the full-size configurations (GPT-2 small, Llama-style 1B)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import step_time
from benchmarks.common import machine_info, write_json

#: run first (the headline ratios: DP against non-DP, ours against Opacus), then the rest while time remains
PRIORITY = ["gpt/1proc/nondp", "gpt/1proc/ours-all", "gpt/1proc/naive", "gpt/zero0/nondp", "gpt/zero0/layer",
            "gpt/zero3/nondp", "gpt/zero3/layer", "gpt/zero3/all", "gpt/1proc/opacus-hooks",
            "gpt/zero3-fp16/nondp", "gpt/zero3-fp16/layer", "gpt/zero3-fp16/all", "gpt/1proc/ours-layer",
            "gpt-lora/zero3/nondp", "gpt-lora/zero3/layer"]
#: profiled after the timed runs: is DeepSpeed-path DP bound by the GPU's arithmetic or by the host's launches?
PROFILE = r"^gpt/zero3/(nondp|layer|all)$"
#: the fp16 (16-mixed) configurations, renamed from ZeRO-3's
FP16 = ("gpt/zero3/nondp", "gpt/zero3/layer", "gpt/zero3/all")


#: the full-size models of ``--full`` (``benchmarks.models.GPT`` keyword arguments) and their tiny ``--smoke`` forms
FULL_MODELS = {"gpt-gpt2-small": dict(vocab=50257, d_model=768, heads=12, layers=12, seq=1024),
               "gpt-llama-1b": dict(vocab=32000, d_model=2048, heads=32, kv_heads=4, layers=22, seq=1024,
                                    llama=True, ffn=5632)}
FULL_SMOKE = {"gpt-gpt2-small": dict(vocab=64, d_model=48, heads=4, layers=2, seq=16),
              "gpt-llama-1b": dict(vocab=64, d_model=64, heads=8, kv_heads=2, layers=2, seq=16, llama=True, ffn=96)}


def full_cases(args) -> tuple[list[dict], dict]:
    """``--full``'s configurations (see the module docstring) and each model's keyword arguments."""
    smoke = args.smoke
    sizes = FULL_SMOKE if smoke else FULL_MODELS
    models = dict(sizes, **{"gpt-llama-1b-lora": dict(sizes["gpt-llama-1b"], lora_rank=8)})
    common = dict(stage=3, world=1, batch=4 if smoke else 8, warmup=1 if smoke else args.warmup,
                  steps=2 if smoke else args.steps, precision="32-true" if smoke else "bf16-mixed",
                  accelerator="cpu" if smoke else "gpu")
    cases = []
    for model, kw in models.items():
        group = f"{model}/zero3"
        methods = ("nondp", "layer") if kw.get("lora_rank") else ("nondp", "layer", "all")
        for method in methods:
            cases.append(step_time.lightning_case(group, method, model=model, model_kw=kw, **common,
                                                  **step_time.METHODS[method]))
    return cases, models


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: proves the script end to end")
    ap.add_argument("--full", action="store_true",
                    help="the full-size configurations: GPT-2 small, a Llama-style 1B full and LoRA (bf16-mixed, ZeRO-3)")
    ap.add_argument("--budget-s", type=float, default=360.0, help="start no configuration after this")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/step_time_gpu.json)")
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--single-batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per configuration")
    ap.add_argument("--only", help="regular expression on configuration names (their baselines are kept)")
    ap.add_argument("--profile", default=PROFILE, metavar="REGEX",
                    help="after the timed runs, while the budget lasts, launch the configurations matching this "
                         "once more under torch.profiler (host and GPU): where a DP step's time goes ('' for none)")
    args = ap.parse_args(argv)
    out = Path(args.out or os.path.join(os.environ.get("OUT", "."), "step_time_gpu.json"))
    st_argv = ["--models", "gpt", "--world", "1", "--stages", "0,3", "--detail-stage", "3",
               "--d-model", str(args.d_model), "--heads", str(args.heads), "--layers", str(args.layers),
               "--seq", str(args.seq), "--batch", str(args.batch), "--single-batch", str(args.single_batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--precision", args.precision,
               "--timeout", str(args.timeout), "--accelerator", "gpu"]
    if args.smoke:
        st_argv = ["--models", "gpt", "--world", "1", "--stages", "0,3", "--detail-stage", "3",
                   "--d-model", "64", "--heads", "2", "--layers", "1", "--seq", "32", "--batch", "4",
                   "--single-batch", "8", "--steps", "2", "--warmup", "1", "--precision", "32-true",
                   "--threads-per-proc", "1", "--single-threads", "1", "--timeout", "300", "--accelerator", "cpu",
                   "--only", r"zero3/(nondp|layer|all)$|lora.*|1proc/(nondp|ours-all|naive|opacus-hooks)$"]
        args.budget_s = 1e9
        args.profile = args.profile and r"^gpt/zero3/(nondp|all)$"
    sargs = step_time.parse_args(st_argv)
    cases = step_time.build_cases(sargs)
    full_kw = None
    if args.full:  # the full-size configurations only: no fp16, no one-process methods, no profile
        cases, full_kw = full_cases(args)
        args.profile = ""
        if not args.smoke:  # the defaults of --full (given values are kept)
            args.budget_s = 480.0 if args.budget_s == 360.0 else args.budget_s
            args.timeout = 240.0 if args.timeout == 120.0 else args.timeout
    elif not args.smoke:  # DeepSpeed's fp16 (loss-scaled) on ZeRO-3 beside the bf16 cases; its CPU build refuses fp16
        fp16 = step_time.build_cases(step_time.parse_args(st_argv + ["--precision", "16-mixed", "--lora-rank", "0"]))
        cases += [dict(c, name=c["name"].replace("gpt/zero3/", "gpt/zero3-fp16/"), group="gpt/zero3-fp16",
                       baseline="gpt/zero3-fp16/nondp") for c in fp16 if c["name"] in FP16]
    everything = list(cases)  # --profile chooses among all of them, --only or not
    if args.only:  # a second run measures what a first left out: the configurations named, with their baselines
        rx = re.compile(args.only)
        wanted = {n for c in cases if rx.search(c["name"]) for n in (c["name"], c["baseline"])}
        cases = [c for c in cases if c["name"] in wanted]
    rank = {n: i for i, n in enumerate(PRIORITY)}
    cases.sort(key=lambda c: rank.get(c["name"], len(PRIORITY)))
    # a baseline must run before the cases compared with it
    ordered, names = [], set()
    for c in cases:
        if c["baseline"] not in names and c["baseline"] != c["name"]:
            ordered += [b for b in cases if b["name"] == c["baseline"]]
            names.add(c["baseline"])
        if c["name"] not in names:
            ordered.append(c)
            names.add(c["name"])
    # the workers' logs stay on the machine (a failed configuration's tail is in the JSON): $OUT brings back few files
    logdir = Path(tempfile.mkdtemp(prefix="dpzero-gpu-logs-"))
    facts = {m: step_time.model_facts(m, full_kw[m] if full_kw else step_time.model_kwargs(m, sargs), 1)
             for m in dict.fromkeys(c["model"] for c in ordered)}
    res = {"args": vars(sargs), "gpu_args": vars(args), "sigma": step_time.SIGMA, "C": step_time.CLIP,
           "machine_before": machine_info(), "facts": facts, "results": [], "skipped": []}
    t0 = time.time()
    for cfg in ordered:
        if time.time() - t0 > args.budget_s:
            res["skipped"].append(cfg["name"])
            continue
        r = step_time.launch(cfg, logdir, args.timeout)
        r.update({k: cfg[k] for k in ("name", "group", "baseline", "kind", "model", "method", "world", "batch")})
        r["stage"] = cfg.get("stage")
        res["results"].append(r)
        step_time.finish(res["results"], ordered)
        msg = r.get("error") or (f"wall {1e3 * r['median_s']:9.2f} ms ×{r.get('time_ratio', 1.0):.3f}  "
                                 f"CPU ×{r.get('cpu_ratio', 1.0):.3f}")
        print(f"[{time.time() - t0:5.0f} s] {cfg['name']:28s} {msg}", flush=True)
        if "error" in r:
            print(r["log_tail"][-800:], flush=True)
        res["wall_s"] = time.time() - t0
        write_json(out, res)  # after every configuration: a killed run keeps what it measured
    profile_configurations(res, everything, args, logdir, t0)
    write_json(out, res)
    res["machine_after"] = machine_info()
    times = {r["name"]: r["median_s"] for r in res["results"] if "median_s" in r}
    lines = []
    for ours in ("ours-all", "ours-layer"):
        n, o = times.get("gpt/1proc/naive"), times.get(f"gpt/1proc/{ours}")
        if n and o:
            res[f"naive_speedup_{ours}"] = n / o
            lines.append(f"speed-up of {ours} over the naive per-example loop at batch "
                         f"{sargs.single_batch or sargs.batch}: {n / o:.1f}×")
    write_json(out, res)
    print(f"\nwrote {out}; skipped (budget): {res['skipped'] or 'none'}")
    print(step_time.render(res))
    for line in lines:
        print(line)
    return res


def profile_configurations(res: dict, cases: list[dict], args, logdir: Path, t0: float) -> None:
    """The configurations matching ``args.profile`` once more, rank 0 under torch.profiler over the timed steps
    (``benchmarks.ds_worker``; the GPU's kernels too), while the budget lasts: ``res["profiles"][name]`` (a
    :func:`benchmarks.profile_engine.summarize` result, or the error). Not timed: the profiler slows the host."""
    if not args.profile:
        return
    rx = re.compile(args.profile)
    for cfg in cases:
        if not rx.search(cfg["name"]) or cfg["kind"] != "lightning":
            continue
        if time.time() - t0 > args.budget_s:
            res["skipped"].append(f"{cfg['name']} (profile)")
            continue
        r = step_time.launch(dict(cfg, profile=True), logdir, args.timeout)
        p = r.get("profile_rank0") or {"error": r.get("error", "no profile"), "log_tail": r.get("log_tail", "")[-800:]}
        res.setdefault("profiles", {})[cfg["name"]] = p
        print(f"[{time.time() - t0:5.0f} s] profile {cfg['name']:20s} {profile_line(p)}", flush=True)


def profile_line(p: dict) -> str:
    """One line of a profile: the step's host time, the GPU's busy time and kernels, the engine's labels."""
    if "error" in p:
        return f"failed: {p['error']}"
    dev = (f"GPU busy {p['device_ms_per_step']:.1f} ms, {p['kernels_per_step']:.0f} kernels"
           if "device_ms_per_step" in p else "no GPU kernels recorded")
    labels = ", ".join(f"{k.removeprefix('dpzero.')} {v:.1f}" for k, v in list(p["labels_ms"].items())[:4])
    return f"host {p['profiled_step_ms']:.1f} ms/step; {dev}; host ms in {labels or 'no engine labels'}"


def first_measured(gpu: dict) -> dict:
    """``{configuration name: result}`` from the first run of ``step_time_gpu.json`` that measured it (its ratios
    are to that run's own baseline)."""
    found: dict = {}
    for run in gpu["runs"]:
        for r in run["results"]:
            if "median_s" in r:
                found.setdefault(r["name"], r)
    return found


def render_section(gpu: dict) -> str:
    """The benchmarks page's GPU section from ``benchmarks/results/step_time_gpu.json`` (``{"runs": [...]}``: each
    run a :func:`main` result; ratios compare configurations of the same run only)."""
    runs = gpu["runs"]
    by = [{r["name"]: r for r in run["results"]} for run in runs]
    first = first_measured(gpu)

    def x(name, key="time_ratio"):
        v = first.get(name, {}).get(key)
        return "not measured" if v is None else f"{v:.2f}×"

    m, a = runs[0]["machine_before"], runs[0]["args"]
    floor = runs[0]["facts"]["gpt"]["floor"]
    naive = next((run[k] for run in runs for k in ("naive_speedup_ours-all",) if k in run), None)
    tests = "; ".join(f"run {i + 1}: {run['cuda_tests']}" for i, run in enumerate(runs) if run.get("cuda_tests"))
    parts = [
        "## On a GPU",
        "",
        f"`bash benchmarks/gpu.sh` on one {m.get('gpu')} (torch {m.get('torch')}, DeepSpeed {m.get('deepspeed')}, "
        f"Lightning {m.get('lightning')}, Opacus {m.get('opacus')}). It first runs the CUDA tests "
        "(`tests/lightning/test_cuda.py`: ZeRO 0–3 in fp32, bf16-mixed and fp16 against the per-example reference, and the "
        f"noise drawn on the GPU; {tests}), then times the GPT at GPT-2-small width (d {a['d_model']}, "
        f"{a['heads']} heads, {a['layers']} layers, sequence {a['seq']}): Lightning + DeepSpeed on the one GPU "
        f"with micro-batch {a['batch']} in {a['precision']} (and fp16, `16-mixed`, on ZeRO-3), and one process at "
        f"batch {a['single_batch']} in fp32 with TF32 matrix products. {a['warmup']} warm-up then {a['steps']} "
        "timed steps per configuration, each in its own process launch; the median wall-clock step (the GPU "
        f"synchronised at each step) is shown. The GPU time at hand allowed {len(runs)} runs: each later run "
        "measured what the earlier ones left out, beside baselines of its own, and every ratio compares "
        "configurations of one run.",
        "",
        "What the runs found:",
        "",
        "* The CUDA tests found that DeepSpeed's fp16 at ZeRO stage 0 divides the gradients by a loss scale it "
        "never put on the loss (every update 256 times too small in the test, with or without DP). The strategy "
        "now stops such a run at its first backward and names the fix (bf16-mixed, or ZeRO stage 1 or above); "
        "with that case moved to ZeRO-1, every CUDA test passed.",
        "* At DeepSpeed's default initial loss scale (2^16) the gradient reaching an fp16 loss (the scale itself) "
        "overflows fp16, and the fp16 DP configurations stopped on their first step. Such steps are now skipped "
        "as DeepSpeed skips them without DP (and charged to the ledger), tested on the CPU; the fp16 DP step "
        "times are not measured yet.",
        f"* One process, batch {a['single_batch']}: our all-layer clipping took {x('gpt/1proc/ours-all')} the "
        f"non-private step and layer-wise {x('gpt/1proc/ours-layer')}; Opacus 1.6 took "
        f"{x('gpt/1proc/opacus-hooks')} (hooks) and {x('gpt/1proc/opacus-ghost')} (ghost clipping), and its hooks "
        f"held {x('gpt/1proc/opacus-hooks', 'cuda_peak_ratio')} the GPU memory of non-private training (ours "
        f"{x('gpt/1proc/ours-all', 'cuda_peak_ratio')}). A backward per example took "
        f"{x('gpt/1proc/naive')} the non-private step"
        + (f", so our all-layer step is {naive:.0f} times faster than that loop (Lee and Kifer report 54 to 94 "
           "times for their models)." if naive else "."),
        f"* Under DeepSpeed the cost is far above the floor of {floor:.2f}: ZeRO-3 all-layer "
        f"{x('gpt/zero3/all')}, group-wise {x('gpt/zero3/group')}, layer-wise {x('gpt/zero3/layer')} (automatic "
        f"clipping {x('gpt/zero3/layer-auto')}), two-pass {x('gpt/zero3/all-2pass')}; ZeRO-0 layer-wise "
        f"{x('gpt/zero0/layer')}, all-layer {x('gpt/zero0/all')}, two-pass {x('gpt/zero0/all-2pass')}; LoRA "
        f"(ZeRO-3, layer-wise) {x('gpt-lora/zero3/layer')}. A non-private step here takes "
        f"{1e3 * by[0]['gpt/zero0/nondp']['median_s']:.0f}–{1e3 * by[0]['gpt/zero3/nondp']['median_s']:.0f} ms, "
        "and the engine's per-layer work is many small kernels with Python between them, which a GPU at this "
        "size does not hide (on the CPU, where the arithmetic dominates, the same methods come much closer to "
        "their floor: see the tables above). GPU memory at its peak stayed within "
        f"{max(r.get('cuda_peak_ratio', 1) for rs in by for n, r in rs.items() if '/zero' in n):.2f}× non-DP "
        "under DeepSpeed.",
        "",
    ]
    profiles = [(name, p) for run in runs for name, p in run.get("profiles", {}).items() if "error" not in p]
    if profiles:
        parts += ["### Where the step's time goes", "",
                  "Rank 0 under torch.profiler over the timed steps, host and GPU (a launch of its own: the profiler "
                  "slows the host, so these times are longer than the timed ones). When the host's time per step is "
                  "well above the GPU's busy time, the step waits on Python and kernel launches, not on arithmetic.",
                  "", "| configuration | host ms per step | GPU busy ms per step | kernels per step |", "|---|---|---|---|"]
        parts += [f"| {name} | {p['profiled_step_ms']:.1f} | {p.get('device_ms_per_step', float('nan')):.1f} | "
                  f"{p.get('kernels_per_step', 0):.0f} |" for name, p in profiles]
        parts.append("")
    for i, run in enumerate(runs):
        parts += [f"### Run {i + 1} of {len(runs)}", "", step_time.render(run), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
