"""Whole-step time and memory of DP training against non-DP, one process launch per configuration.

Two groups of configurations per model (the GPT-style decoder, the same at GPT-2-small width with two blocks
("gpt-wide", Lightning runs only) and the small CNN of ``benchmarks.models``):

* **Lightning + DeepSpeed, W processes** (W = 2 on the CPU, launched like ``torchrun``: MASTER_ADDR/PORT,
  RANK, LOCAL_RANK, WORLD_SIZE in the environment, so Lightning does not relaunch): the non-DP baseline is
  Lightning's own ``DeepSpeedStrategy`` (subclassed here with the same three CPU overrides that
  ``DPDeepSpeedStrategy`` has), at ZeRO stages 0, 2 and 3; against it ``DPDeepSpeedStrategy`` at the same
  stage with layer-wise, all-layer and group-wise clipping, Abadi and automatic clipping functions
  (σ = 1, C = 1, ``poisson_sampling=False`` so every micro-batch has exactly B examples); LoRA adapters
  on the GPT (DP and non-DP). Adam, fp32 (``--precision``), the same micro-batch on every rank.
* **one process, plain PyTorch loop**: non-DP, our ``PerSampleEngine`` (layer-wise and all-layer, then
  noise and the division by B as DeepSpeed's pre-step hook would), Opacus 1.6 ``hooks`` and ``ghost``
  (flat clipping), a naive per-example loop, and ``torch.func`` ``vmap(grad)``; same model, batch W·B,
  all-layer clipping for the peers, Adam.

Each configuration: ``--warmup`` untimed steps, then ``--steps`` timed steps; the step time is the median
over steps (each step's time is the slowest rank's, from batch start to the end of the optimizer step).
Beside it: peak RSS per process (the kernel's high-water mark ``VmHWM``, reset just before training, so
imports are excluded from the growth but included in the absolute peak), and for DeepSpeed runs the
model-state bytes per rank found by walking the engine's parameters, gradients, optimizer states and
ZeRO buffers (storages counted once), against the ZeRO paper's formula.

Ratios are to the non-DP baseline *of the same run and group*. The arithmetic floor beside each ratio is
``1 + min(T(d+p), d·p)/(3·d·p)`` per Linear, FLOP-weighted over the model (``benchmarks.models.model_floor``).

Usage::

    python -m benchmarks.step_time [--models gpt,cnn] [--only REGEX] [--steps 5] [--warmup 2]
    python -m benchmarks.step_time --list          # the configurations, without running them

The workers are ``benchmarks.ds_worker`` (Lightning + DeepSpeed) and ``benchmarks.single_worker`` (one
process); ``benchmarks.launch`` starts them and merges the ranks' results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import CLIP, RESULTS, SIGMA, machine_info, md_table, write_json  # noqa: F401 (re-exported)
from benchmarks.common import STEADY_MALLOC
from benchmarks.launch import ROOT, launch  # noqa: F401 (re-exported: benchmarks.gpu launches through here)
from benchmarks.models import build_model, linear_shapes, make_data, model_floor, param_count, zero_model_states


# ===================================================================================== configurations
def model_kwargs(model: str, args) -> dict:
    if model == "gpt-wide":  # GPT-2-small width, few blocks: the d 768 targets
        return dict(vocab=args.vocab, d_model=args.wide_d_model, heads=args.wide_heads, layers=args.wide_layers,
                    seq=args.wide_seq)
    if model.startswith("gpt"):
        kw = dict(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers, seq=args.seq)
        if model == "gpt-lora":
            kw["lora_rank"] = args.lora_rank
        return kw
    return dict(channels=args.cnn_channels, image=32, classes=10)


#: the strategy settings of each DP method name (``nondp``: Lightning's own DeepSpeedStrategy)
METHODS = {"nondp": {}, "layer": dict(clipping="layer-wise", clipping_fn="abadi"),
           "all": dict(clipping="all-layer", clipping_fn="abadi"),
           "all-2pass": dict(clipping="all-layer", clipping_fn="abadi", clipping_mode="two-pass")}


def lightning_case(group: str, method: str, *, model: str, model_kw: dict, stage: int, world: int, batch: int,
                   warmup: int, steps: int, threads: int = 1, precision: str = "32-true", accelerator: str = "cpu",
                   accumulate: int = 1, profile: bool = False, **kw) -> dict:
    """One Lightning + DeepSpeed configuration ``GROUP/METHOD`` against the baseline ``GROUP/nondp``; ``kw``
    are the DP strategy's settings (``clipping``, ``clipping_fn``, ...) and ``strategy_kw`` (both strategies)."""
    return dict(name=f"{group}/{method}", group=group, baseline=f"{group}/nondp", kind="lightning", model=model,
                model_kw=model_kw, stage=stage, method=method, world=world, batch=batch, threads=threads,
                precision=precision, accelerator=accelerator, accumulate=accumulate, profile=profile,
                warmup=warmup, steps=steps, seed=0, **kw)


def gpt_groups(layers: int) -> list[list[str]]:
    """Group-wise clipping of the GPT: embeddings, one group per block, the final LayerNorm with the head."""
    return ([["net.tok.*", "net.pos.*"]] + [[f"net.blocks.{i}.*"] for i in range(layers)]
            + [["net.ln_f.*", "net.head.*"]])


def build_cases(args) -> list[dict]:
    """Every configuration, in the order run: each DP case right after its non-DP baseline."""
    cases = []
    W = args.world
    common = dict(warmup=args.warmup, steps=args.steps, accelerator=args.accelerator, seed=0)

    def micro(model):
        if model == "gpt-wide":
            return args.wide_batch
        return args.cnn_batch if model == "cnn" and args.cnn_batch else args.batch

    acc = f"/acc{args.accumulate}" if args.accumulate > 1 else ""

    def ds(model, stage, method, **kw):
        cases.append(lightning_case(f"{model}/zero{stage}{acc}", method, model=model,
                                    model_kw=model_kwargs(model, args), stage=stage, world=W, batch=micro(model),
                                    warmup=args.warmup, steps=args.steps, threads=args.threads_per_proc,
                                    precision=args.precision, accelerator=args.accelerator,
                                    accumulate=args.accumulate, profile=args.profile, **kw))

    def single(model, method):
        cases.append(dict(common, name=f"{model}/1proc/{method}", group=f"{model}/1proc",
                          baseline=f"{model}/1proc/nondp", kind="single", model=model,
                          model_kw=model_kwargs(model, args), method=method, world=1,
                          batch=micro(model) * W if args.single_batch is None else args.single_batch,
                          threads=args.single_threads))

    for model in args.models:
        stages = args.stages
        if model == "gpt":
            for s in stages:
                ds("gpt", s, "nondp")
                ds("gpt", s, "layer", clipping="layer-wise", clipping_fn="abadi")
                ds("gpt", s, "all", clipping="all-layer", clipping_fn="abadi")
                ds("gpt", s, "all-2pass", **METHODS["all-2pass"])
                if s == args.detail_stage:
                    ds("gpt", s, "group", clipping="group-wise", clipping_fn="abadi",
                       clipping_groups=gpt_groups(args.layers))
                    ds("gpt", s, "layer-auto", clipping="layer-wise", clipping_fn="automatic")
            if args.lora_rank:
                ds("gpt-lora", args.detail_stage, "nondp")
                ds("gpt-lora", args.detail_stage, "layer", clipping="layer-wise", clipping_fn="abadi")
        elif model == "gpt-wide":
            for s in args.wide_stages:
                ds("gpt-wide", s, "nondp")
                ds("gpt-wide", s, "layer", clipping="layer-wise", clipping_fn="abadi")
                ds("gpt-wide", s, "all", clipping="all-layer", clipping_fn="abadi")
                ds("gpt-wide", s, "all-2pass", **METHODS["all-2pass"])
            continue  # no one-process runs of the wide GPT
        elif model == "cnn":
            for s in stages:
                ds("cnn", s, "nondp")
                ds("cnn", s, "layer", clipping="layer-wise", clipping_fn="abadi")
                if s == max(stages):
                    ds("cnn", s, "all", clipping="all-layer", clipping_fn="abadi")
                    ds("cnn", s, "all-2pass", **METHODS["all-2pass"])
        for m in args.single_methods:
            single(model, m)
    if args.only:
        rx = re.compile(args.only)
        keep = {c["name"] for c in cases if rx.search(c["name"])}
        keep |= {c["baseline"] for c in cases if c["name"] in keep}
        cases = [c for c in cases if c["name"] in keep]
    return cases



def model_facts(model: str, kw: dict, world: int) -> dict:
    """Ψ, the Linear shapes and the FLOP-weighted arithmetic floor, and ZeRO formulas per stage."""
    kind = "gpt" if model.startswith("gpt") else "cnn"
    torch.manual_seed(0)
    net = build_model(kind, **kw)
    x, _ = make_data(kind, 1, **kw)
    shapes = linear_shapes(net, x)
    psi, psi_t = param_count(net), param_count(net, trainable_only=True)
    facts = {"psi": psi, "psi_trainable": psi_t, "linear_shapes": shapes, "floor": model_floor(shapes)}
    if psi == psi_t:
        facts["zero_formula_mixed_bytes"] = {s: zero_model_states(psi, world, s) for s in (0, 1, 2, 3)}
        facts["zero_formula_fp32_bytes"] = {s: zero_model_states(psi, world, s, 4, 4, 12) for s in (0, 1, 2, 3)}
        try:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

            largest = max(m.weight.numel() + (m.bias.numel() if getattr(m, "bias", None) is not None else 0)
                          for m in net.modules() if hasattr(m, "weight") and isinstance(m.weight, torch.Tensor))
            facts["deepspeed_estimate_bytes"] = {
                2: estimate_zero2_model_states_mem_needs(psi, world, cpu_offload=False)[1],
                3: estimate_zero3_model_states_mem_needs(psi, largest, world, cpu_offload=False)[1]}
        except Exception as e:  # noqa: BLE001 - DeepSpeed absent or its API moved
            facts["deepspeed_estimate_error"] = repr(e)
    return facts


def finish(results: list[dict], cases: list[dict]) -> None:
    """Ratios to the baseline of the same group and run."""
    by_name = {r["name"]: r for r in results}
    for r in results:
        b = by_name.get(r["baseline"])
        if "error" in r or b is None or "error" in b:
            continue
        r["time_ratio"] = r["median_s"] / b["median_s"]
        r["cpu_ratio"] = r["cpu_median_s"] / b["cpu_median_s"] if b["cpu_median_s"] > 0 else float("nan")
        r["rss_peak_ratio"] = max(r["rss_peak_mb"]) / max(b["rss_peak_mb"])
        gr, gb = max(r["rss_growth_mb"]), max(b["rss_growth_mb"])
        r["rss_growth_ratio"] = gr / gb if gb > 0 else float("nan")
        if "alloc_step_peak_mb" in r and "alloc_step_peak_mb" in b:
            r["alloc_step_peak_ratio"] = max(r["alloc_step_peak_mb"]) / max(b["alloc_step_peak_mb"])
        if "cuda_peak_mb" in r and "cuda_peak_mb" in b:
            r["cuda_peak_ratio"] = max(r["cuda_peak_mb"]) / max(b["cuda_peak_mb"])


def interleaved(res: dict, cases: list[dict], args, logdir: Path) -> None:
    """The time ratios again, each group's methods taking turns step by step in one launch
    (:mod:`benchmarks.interleave`): ``paired_*`` fields on each DP result, ``res['interleave']`` per group."""
    from benchmarks.interleave import run_group

    groups: dict[str, list[dict]] = {}
    for c in cases:
        groups.setdefault(c["group"], []).append(dict(c, steps=args.interleave_steps))
    by_name = {r["name"]: r for r in res["results"]}
    res["interleave"] = {"steps": args.interleave_steps, "warmup": args.warmup, "groups": {}}
    for group, members in groups.items():
        members.sort(key=lambda c: c["name"] != c["baseline"])  # the baseline first
        if len(members) < 2 or members[0]["name"] != members[0]["baseline"]:
            continue
        out = run_group(members, logdir, args.timeout)
        res["interleave"]["groups"][group] = {k: v for k, v in out.items() if k in ("launch_wall_s", "error")}
        if "error" in out:
            print(f"{group:32s} interleaved: {out['error']}\n{out['log_tail'][-1500:]}", flush=True)
            continue
        for name, paired in out.items():
            if isinstance(paired, dict) and name in by_name:
                by_name[name].update(paired)
                q = paired["paired_cpu_quartiles"]
                print(f"{name:32s} interleaved: CPU ×{paired['paired_cpu_ratio']:.3f} (quartiles "
                      f"{q[0]:.3f}–{q[1]:.3f}, {paired['paired_rounds']} rounds)", flush=True)


def render(res: dict) -> str:
    """Markdown tables: step time, ratio, floor and memory per configuration; ZeRO model states."""
    facts = res["facts"]
    rows = []
    for r in res["results"]:
        f = facts[r["model"]]
        if "error" in r:
            rows.append([r["name"], "failed: " + r["error"]] + [None] * 10)
            continue
        gpu = "cuda_peak_mb" in r
        q = r.get("paired_cpu_quartiles")
        paired = (f"{r['paired_cpu_ratio']:.3f} ({q[0]:.2f}–{q[1]:.2f})" if q else
                  (f"{r['paired_cpu_ratio']:.3f}" if "paired_cpu_ratio" in r else None))
        rows.append([r["name"], 1e3 * r["median_s"], r.get("time_ratio"), 1e3 * r["cpu_median_s"],
                     r.get("cpu_ratio"), paired, f["floor"] if r["method"] != "nondp" else None,
                     max(r["cuda_peak_mb"]) if gpu else max(r["rss_peak_mb"]),
                     r.get("cuda_peak_ratio") if gpu else r.get("rss_peak_ratio"),
                     None if gpu else max(r["rss_growth_mb"]), None if gpu else r.get("rss_growth_ratio"),
                     len(r["step_s"])])
    mem = "CUDA peak" if any("cuda_peak_mb" in r for r in res["results"]) else "peak RSS"
    out = [md_table(["configuration", "wall ms", "× non-DP", "CPU ms (Σ procs)", "× non-DP",
                     "interleaved CPU × non-DP (quartiles)", "floor",
                     f"{mem} MB/proc", "× non-DP",
                     "RSS growth MB", "× non-DP", "timed steps"], rows)]
    zrows = []
    for r in res["results"]:
        ms = r.get("model_states")
        if not ms or "error" in r or r["method"] != "nondp":
            continue
        f, s = facts[r["model"]], r["stage"]
        mb = lambda v: None if v is None else v / 2**20  # noqa: E731

        def at(key):  # JSON turns the stage keys into strings
            d = f.get(key, {})
            return d.get(s, d.get(str(s)))

        zrows.append([r["name"], f["psi"], mb(at("zero_formula_mixed_bytes")), mb(at("zero_formula_fp32_bytes")),
                      mb(at("deepspeed_estimate_bytes")),
                      mb(ms["params"]), mb(ms["grads"]), mb(ms["optimizer"]), mb(ms["model_states"]),
                      mb(ms["buffers"])])
    if zrows:
        out.append("**ZeRO model states per rank** (MB; formula: mixed-precision Adam 2Ψ+2Ψ+12Ψ per the ZeRO "
                   "paper, and the same with 4-byte parameters and gradients as in these fp32 runs; DeepSpeed's "
                   "own estimator (device memory, no offload); measured: storages reachable from the engine "
                   "after the last backward, before the update)\n\n"
                   + md_table(["run", "Ψ", "formula mixed", "formula fp32", "DeepSpeed estimate", "params",
                               "grads", "optimizer", "measured model states", "ZeRO buffers (allocated)"], zrows))
    return "\n\n".join(out) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="gpt,gpt-wide,cnn", type=lambda s: s.split(","))
    ap.add_argument("--only", help="regular expression on configuration names (their baselines are kept)")
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    ap.add_argument("--stages", default="0,2,3", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--detail-stage", type=int, default=2, help="stage of the group-wise, automatic, LoRA runs")
    ap.add_argument("--single-methods", default="nondp,ours-layer,ours-all,opacus-hooks,opacus-ghost,naive,func",
                    type=lambda s: [m for m in s.split(",") if m])
    ap.add_argument("--world", type=int, default=2, help="processes of the Lightning/DeepSpeed runs")
    ap.add_argument("--batch", type=int, default=8, help="micro-batch per process (one process: world × batch)")
    ap.add_argument("--single-batch", type=int, default=None, help="batch of the one-process runs")
    ap.add_argument("--threads-per-proc", type=int, default=1, help="torch threads of each DeepSpeed rank")
    ap.add_argument("--single-threads", type=int, default=1, help="torch threads of the one-process runs")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--interleave-steps", type=int, default=24,
                    help="then time each group again with its methods taking turns step by step in one launch, "
                         "this many rounds after the warm-up (0: not)")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="accumulate_grad_batches of the DeepSpeed runs (> 1: configurations named .../accK/...)")
    ap.add_argument("--precision", default="32-true", help="Lightning precision of the DeepSpeed runs")
    ap.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--wide-d-model", type=int, default=768, help="d_model of the gpt-wide model")
    ap.add_argument("--wide-heads", type=int, default=12)
    ap.add_argument("--wide-layers", type=int, default=2)
    ap.add_argument("--wide-seq", type=int, default=256)
    ap.add_argument("--wide-batch", type=int, default=4, help="micro-batch per process of gpt-wide")
    ap.add_argument("--wide-stages", default="2,3", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--lora-rank", type=int, default=8, help="0: no LoRA runs")
    ap.add_argument("--cnn-channels", type=int, default=32)
    ap.add_argument("--cnn-batch", type=int, default=32, help="micro-batch per process of the CNN (0: --batch)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler on rank 0 over the timed steps (engine, noise and accountant labelled); "
                         "the summary goes into the JSON (profiling slows the steps: use for findings only)")
    ap.add_argument("--logdir", default=None, help="worker logs (default: a temporary directory)")
    ap.add_argument("--out", default=str(RESULTS / "step_time_cpu.json"))
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        cfg = json.loads(Path(args.worker).read_text())
        t0 = time.time()
        if cfg["kind"] == "lightning":
            from benchmarks.ds_worker import lightning_worker as work
        elif cfg["kind"] == "interleaved-lightning":
            from benchmarks.interleave import lightning_interleaved as work
        elif cfg["kind"] == "interleaved-single":
            from benchmarks.interleave import single_interleaved as work
        else:
            from benchmarks.single_worker import single_worker as work
        out = work(cfg)
        out["worker_s"] = time.time() - t0  # set-up + steps, after the interpreter and imports started
        Path(args.result).write_text(json.dumps(out))
        return out
    cases = build_cases(args)
    if args.list:
        for c in cases:
            print(c["name"], "baseline:", c["baseline"])
        return {}
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="dpzero-bench-"))
    logdir.mkdir(parents=True, exist_ok=True)
    print(f"{len(cases)} configurations; worker logs in {logdir}", flush=True)
    facts = {m: model_facts(m, model_kwargs(m, args), args.world)
             for m in dict.fromkeys(c["model"] for c in cases)}
    res = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "result")},
           "sigma": SIGMA, "C": CLIP, "malloc_env": STEADY_MALLOC, "machine_before": machine_info(), "facts": facts,
           "results": []}
    t_start = time.time()
    for cfg in cases:
        r = launch(cfg, logdir, args.timeout)
        r.update({k: cfg[k] for k in ("name", "group", "baseline", "kind", "model", "method", "world", "batch")})
        r["stage"] = cfg.get("stage")
        r["load_average"] = list(os.getloadavg())
        res["results"].append(r)
        finish(res["results"], cases)
        msg = r.get("error") or (f"wall {1e3 * r['median_s']:8.1f} ms ×{r.get('time_ratio', 1.0):.3f}  "
                                 f"CPU {1e3 * r['cpu_median_s']:8.1f} ms ×{r.get('cpu_ratio', 1.0):.3f}  "
                                 f"peak RSS {max(r['rss_peak_mb']):.0f} MB  ({r['launch_wall_s']:.0f} s)")
        print(f"{cfg['name']:32s} {msg}", flush=True)
        if "error" in r:
            print(r["log_tail"][-1500:], flush=True)
    if args.interleave_steps and not args.profile:
        interleaved(res, cases, args, logdir)
    res["wall_s"] = time.time() - t_start
    res["machine_after"] = machine_info()
    write_json(args.out, res)
    print(render(res), flush=True)
    return res


if __name__ == "__main__":
    main()
