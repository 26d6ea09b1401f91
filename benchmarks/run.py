"""Run every CPU benchmark and render the benchmarks pages with their tables and a PNG plot.

Usage::

    python -m benchmarks.run                    # per-layer, engine profile, step time, ε accuracy, scaling
                                                # grid, largest model (~2 h on 2 shared cores), render
    python -m benchmarks.run --render-only      # re-render both pages and the plot from the committed JSON
    python -m benchmarks.run --skip-per-layer   # step time only (per-layer JSON reused)

Every flag of ``benchmarks.step_time`` can follow ``--`` (e.g. ``-- --steps 4 --models gpt``).
Outputs: ``benchmarks/results/per_layer_cpu.json``, ``per_layer_rnn_cpu.json``, ``profile_engine_cpu.json``,
``step_time_cpu.json``, ``epsilon_accuracy.json``, ``scaling_cpu.json``, ``largest_model_cpu.json``,
``largest_model_offload_cpu.json`` (ZeRO-3 with offload, all-layer in two passes too),
``step_time_cpu.png`` (all under ``benchmarks/results/``), and two pages: ``docs/benchmarks.md``, one screen for
users (what DP costs on the CPU and the GPU, against Opacus, the plot: ``benchmarks.summary_page``), and
``docs/benchmarks-method.md``, the method and the run history, which also includes
``benchmarks/results/step_time_profile_cpu.json`` (a ``step_time --profile`` run) and the hand-written
``benchmarks/results/analysis.md`` when they exist, and opens with a summary in words.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import epsilon_accuracy, gpu, largest_model, per_layer, profile_engine, scaling, step_time
from benchmarks.common import RESULTS, STEADY_MALLOC, load_average, md_table
from benchmarks.report import TARGET_NOTES, cpu_ratio, model_line, summary, targets
from benchmarks.summary_page import GENERATED, render_summary

ROOT = Path(__file__).resolve().parent.parent
DOC, METHOD_DOC = ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "benchmarks-method.md"
PNG = RESULTS / "step_time_cpu.png"

def _load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def plot(st: dict, path: Path) -> None:
    """Horizontal bars: step time × non-DP per configuration, with the arithmetic floor marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "cpu_ratio" if any("cpu_ratio" in r for r in st["results"]) else "time_ratio"
    rows = [dict(r, cpu_ratio=cpu_ratio(r)) for r in st["results"] if key in r and r["method"] != "nondp"]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.4))
    labels = [r["name"] for r in rows]
    ratios = [r[key] for r in rows]
    colors = ["#1f77b4" if r["kind"] == "lightning" else "#ff7f0e" for r in rows]
    y = list(range(len(rows)))[::-1]
    ax.barh(y, ratios, color=colors)
    for yi, r in zip(y, rows):
        ax.plot([st["facts"][r["model"]]["floor"]] * 2, [yi - 0.4, yi + 0.4], color="k", lw=1.5)
        ax.text(r[key] * 1.02, yi, f"{r[key]:.2f}", va="center", fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xscale("log")
    ticks = [1, 1.25, 1.5, 2, 3, 4, 6]
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    ax.axvline(1.0, color="grey", lw=0.8)
    what = "CPU time per step" if key == "cpu_ratio" else "step time"
    how = "steps taken in turn" if any("paired_cpu_ratio" in r for r in st["results"]) else "same run"
    # two lines, and the saved area grown to the text: one line was wider than the figure and was cut off
    ax.set_xlabel(f"{what} / non-DP of the same group, {how} (log scale)\nblack tick: arithmetic floor", fontsize=8)
    ax.set_title("DP step time over non-DP (blue: Lightning+DeepSpeed, 2 procs; orange: 1 process)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.1)
    plt.close(fig)


def scaling_section(sc: dict) -> str:
    a = sc["args"]
    return "\n".join([
        "## Cost against width, length and batch",
        "",
        f"`python -m benchmarks.scaling`: the GPT-style decoder with {a['layers']} blocks, d/64 heads, ZeRO-{a['stage']}, "
        f"{a['world']} processes × micro-batch B, {a['warmup']} warm-up step then {a['steps']} timed steps (median), "
        "each configuration's non-DP baseline launched just before it; the DP columns are CPU-time and peak-RSS "
        f"ratios to that baseline. A watchdog kills a configuration above {a['rss_limit_mb']:.0f} MB per process. "
        "With so few timed steps on a shared machine read the ratios to about ±0.1 (a DP step cannot be faster "
        "than its non-DP baseline: ratios below 1 are that noise). "
        f"Predicted {sc['estimate_s'] / 60:.0f} min with a free core per process; took "
        + (f"{sc['wall_s'] / 60:.0f} min on the shared machine." if "wall_s" in sc else "(interrupted run)."),
        "",
        scaling.render(sc),
    ])


def largest_section(lm: dict) -> str:
    a = lm["args"]
    return "\n".join([
        "## The largest model that trains",
        "",
        f"`python -m benchmarks.largest_model`: the widest GPT-style decoder ({a['layers']} blocks, head size 32, "
        f"T {a['seq']}, micro-batch {a['batch']} per process, {a['world']} processes, Adam, fp32) that trains one "
        f"step with every process's peak RSS within **{a['budget_mb']:.0f} MB** (libraries included: a tiny model "
        f"already takes {lm['footprint_mb']:.0f} MB), found by search on multiples of 32 starting at the width the "
        "ZeRO formula predicts (fp32 Adam: 4Ψ parameters + 4Ψ gradients + 8Ψ optimizer states per replica, "
        "partitioned by the stage); a watchdog kills a trial once a process crosses the budget. Offload moves "
        "the optimizer states and parameters to CPU memory, which on this CPU-only machine is the same memory, "
        "so it cannot raise the limit here; it shows that DP trains with offload what non-DP does. Cells: "
        "width / Ψ / peak RSS per process. One width step is 3–4% of Ψ here, and the same trial's peak moves by "
        "about ±40 MB between launches, so a DP maximum one step above non-DP's is that noise. The last column "
        "is the formula's model states at non-DP's maximum plus the tiny model's footprint: what the formula "
        "leaves out (activations, DeepSpeed's flat copies and buckets, allocator slack) is the rest of the "
        "budget."
        + _run_length(lm),
        "",
        largest_model.render(lm),
    ])


def _run_length(lm: dict) -> str:
    return (f" Took {lm['wall_s'] / 60:.0f} min, {len(lm['trials'])} trials." if "wall_s" in lm else
            " (interrupted run: the stages it reached)")


def offload_section(lm: dict) -> str:
    """The search of ZeRO-3 with offload alone, with all-layer clipping in two passes beside book-keeping."""
    return "\n".join([
        f"A separate search of the same decoder with ZeRO-3 and offload alone (`python -m benchmarks.largest_model "
        f"--stages {lm['args']['stages']} --methods {lm['args']['methods']} --out benchmarks/results/largest_model_offload_cpu.json`), with "
        "all-layer clipping in two passes (`clipping_mode=\"two-pass\"`) beside book-keeping: two passes keep no "
        "layer's output gradient until the end of the backward pass."
        + _run_length(lm),
        "",
        largest_model.render(lm),
    ])


def _faults_sentence(st: dict) -> str:
    """What the interleaved steps paid in page faults (the median over a method's rounds of the most any
    process's step took), from results that count them."""
    counts = [r[k] for r in st.get("results", []) for k in ("paired_faults_per_step", "paired_baseline_faults_per_step")
              if r.get(k) is not None]
    if not counts:
        return "This run did not count page faults."
    return (f"Counted in this run: a step took at most {max(counts):.0f} minor page faults (the median over the "
            "rounds of every method, non-DP included), against thousands before.")


def render_doc(pl: dict | None, st: dict | None, command: str, rnn: dict | None = None) -> str:
    sc, lm = _load(RESULTS / "scaling_cpu.json"), _load(RESULTS / "largest_model_cpu.json")
    lm_offload = _load(RESULTS / "largest_model_offload_cpu.json")
    eps = _load(RESULTS / "epsilon_accuracy.json")
    m = (st or pl)["machine_before"]
    after = (st or pl).get("machine_after", {})
    parts = [GENERATED, "", "# Benchmarks: method and history", "",
             "How the figures of [Benchmarks](benchmarks.md) were measured, every configuration, the performance "
             "targets, and the history of the runs.", ""]
    if st:
        parts += ["## Summary", "", summary(st), ""]
    parts += [
        "## Reproduce",
        "",
        "```bash",
        ". .venv/bin/activate && pip install -c constraints-cpu.txt -e \".[bench]\"",
        command,
        "```",
        "",
        "It runs, one after the other (each also alone): the per-layer micro-benchmarks "
        "(`python -m benchmarks.per_layer`), the engine profile (`python -m benchmarks.profile_engine`), whole "
        "training steps (`python -m benchmarks.step_time`), the ε accuracy (`python benchmarks/epsilon_accuracy.py "
        "--no-fixed --out benchmarks/results/epsilon_accuracy.json`), the scaling grid (`python -m "
        "benchmarks.scaling`) and the largest-model search (`python -m benchmarks.largest_model`), then renders "
        "this page; `--skip-scaling`, `--skip-largest` and the other `--skip-*` flags leave a part's committed "
        "results as they are.",
        "",
        "GPU figures (the section *On a GPU* below): `bash benchmarks/gpu.sh` runs the CUDA tests and the "
        "step-time cases at GPT-2-small width on one GPU, after "
        "`bash benchmarks/gpu.sh --prepare-wheels` on a machine with the repository (see the script's header); "
        "`bash benchmarks/gpu.sh --smoke` runs the same script on the CPU with a tiny model (a few minutes).",
        "",
        "## Machine",
        "",
        f"* CPU: {m.get('cpu_model', '?')}, {m.get('cpu_count')} cores, {m.get('mem_total_gib')} GiB; "
        f"no GPU. {m.get('platform')}",
        f"* Python {m.get('python')}, torch {m.get('torch')}, Lightning {m.get('lightning')}, "
        f"DeepSpeed {m.get('deepspeed')}, Opacus {m.get('opacus')}",
        "* lightning-dpzero: the repository's source at the time of the run (the JSON files record its revision)"
        + (", with uncommitted changes" if m.get("engine_dirty") else ""),
        f"* Load average (1, 5, 15 min) before: {m.get('load_average')}, after: {after.get('load_average')}. "
        "Other jobs can share the machine, and then wall-clock times are mostly waiting for a "
        "core: the verdicts use CPU time per step (summed over the processes, one torch thread each), which "
        "leaves out the time other jobs held the cores; wall-clock ratios are shown beside them. CPU time "
        "still carries the speed of the core, which drifts on this machine: the interleaved ratios compare "
        "steps taken seconds apart on the same cores.",
        ("* Allocator: every timed process runs with "
        + ", ".join(f"`{k}={v}`" for k, v in st["malloc_env"].items())
        + ". With glibc's defaults a step's large tensors come from fresh pages that are returned and faulted "
        "in again on every step, and how often depends on what else ran in the process (the non-DP CNN step "
        "paid 11–13 thousand page faults alone, 1.5 thousand beside the DP methods): the ratios measured the "
        "allocator as much as the arithmetic. The first two settings keep freed memory in the process. The "
        "third matters to the interleaved runs, which train each method in a thread of its own: glibc gives "
        "a thread a heap of its own, which it does return to the system, and a DP method's thread then paid "
        "5–11 thousand page faults a step on one of the two processes in about half the launches (the LoRA "
        "step read 1.07 in those launches and 1.03 in the others); with it, every thread uses the one heap "
        "that a user's single training thread uses. " + _faults_sentence(st)
        + " The largest-model search keeps the defaults, as a user's run would. On the CPU you can set the "
        "same variables for your own training; on a GPU the caching allocator already keeps its memory."
         if st and st.get("malloc_env") else "* Allocator: glibc's default settings."),
        "",
    ]
    if st:
        a = st["args"]
        f = st["facts"]
        parts += [
            "## Whole training steps",
            "",
            model_line(a, f),
            "",
            f"Lightning + DeepSpeed runs: {a['world']} processes × micro-batch {a['batch']} (GPT), "
            + (f"{a['wide_batch']} (gpt-wide), " if "gpt-wide" in f else "") +
            f"{a.get('cnn_batch') or a['batch']} (CNN) "
            f"({a['threads_per_proc']} thread each), Adam, precision {a['precision']}, σ = {st['sigma']}, "
            f"C = {st['C']}, `poisson_sampling=False`. One-process runs: batch "
            f"{a['single_batch'] or a['world'] * a['batch']} (GPT), "
            f"{a['single_batch'] or a['world'] * (a.get('cnn_batch') or a['batch'])} (CNN), "
            f"{a['single_threads']} thread. "
            f"{a['warmup']} warm-up steps then {a['steps']} timed steps per configuration, one process launch "
            "per configuration; the median is shown (memory comes from these launches). "
            + (f"Then every group once more in one launch, its methods taking turns step by step (the non-DP "
               f"baseline first, in the same processes): {a['warmup']} warm-up rounds and "
               f"{st['interleave']['steps']} timed rounds; the interleaved column is the median over the rounds "
               "of a DP step's CPU time over the baseline's step of the same round, with the quartiles, and the "
               "summary and the verdicts use it. " if st.get("interleave") else "")
            + f"Total wall time {st['wall_s'] / 60:.1f} min.",
            "",
            "Names: `MODEL/zeroS/METHOD` is Lightning + DeepSpeed ZeRO-S (`nondp`: Lightning's DeepSpeedStrategy "
            "with CPU overrides; `layer`, `all`, `group`: DPDeepSpeedStrategy layer-wise, all-layer, group-wise "
            "clipping, Abadi; `layer-auto`: layer-wise automatic clipping). `MODEL/1proc/METHOD` is one process, "
            "plain loop: `ours-layer`/`ours-all` is `PerSampleEngine` + noise; `opacus-hooks`/`opacus-ghost` "
            "Opacus 1.6 (flat clipping); `naive` a backward per example; `func` torch.func vmap(grad).",
            "",
            "Memory: peak RSS per process is the kernel's high-water mark (`VmHWM`) reset just before training "
            "(absolute, libraries included); growth is that peak minus the RSS at the reset.",
            "",
            f"![step time over non-DP](../benchmarks/results/{PNG.name})",
            "",
            step_time.render(st),
            "## Performance targets",
            "",
            TARGET_NOTES,
            "",
            targets(st, sc, [lm, lm_offload], eps, gpu=_load(RESULTS / "step_time_gpu.json")),
            "",
        ]
    if sc:
        parts += [scaling_section(sc), ""]
    if lm:
        parts += [largest_section(lm), ""]
    if lm_offload:
        parts += [offload_section(lm_offload), ""]
    analysis = RESULTS / "analysis.md"
    if analysis.exists():
        parts += [analysis.read_text().rstrip(), ""]
    gpu_results = _load(RESULTS / "step_time_gpu.json")
    if gpu_results:
        parts += [gpu.render_section(gpu_results), ""]
    prof = _load(RESULTS / "profile_engine_cpu.json")
    if prof:
        a = prof["args"]
        parts += [
            "## Where the engine's time goes (torch.profiler)",
            "",
            f"`python -m benchmarks.profile_engine`: the GPT above, one process, {a['threads']} thread, batch "
            f"{a['batch']}, forward + backward only, {a['steps']} profiled steps after {a['warmup']} warm-up; engine "
            "functions wrapped in `record_function` labels inside the benchmark process (inclusive times: nested "
            "labels overlap). The median is thread CPU time over at least 5 unprofiled steps; the profiler's times are wall "
            "times, so they carry the machine's load: read them as shares of a step, not as absolute costs.",
            "",
            profile_engine.render(prof),
        ]
    dsprof = _load(RESULTS / "step_time_profile_cpu.json")
    if dsprof:
        only = dsprof["args"].get("only") or ""
        parts += ["## Profiled DeepSpeed steps (rank 0)", "",
                  f"`python -m benchmarks.step_time --profile --only '{only}' --single-methods '' --out "
                  "benchmarks/results/step_time_profile_cpu.json`: torch.profiler on rank 0 over the timed steps, "
                  "with the engine, the strategy's noise hook, backward/optimizer step and the accountant callback "
                  "labelled (inclusive wall ms per step; profiling slows the step, so its ratios are not the "
                  "benchmark's).", ""]
        for r in dsprof["results"]:
            pr = r.get("profile_rank0")
            if not pr:
                continue
            parts += [f"**{r['name']}**: profiled step {pr['profiled_step_ms']:.0f} ms (rank 0)", "",
                      md_table(["label", "ms/step"], list(pr["labels_ms"].items())[:12]), "",
                      md_table(["operator", "self ms/step", "calls/step"], pr["top_ops"][:12]), ""]
    if pl:
        parts += [
            "## Per-layer micro-benchmark",
            "",
            f"Batch {pl['batch']}, {pl['threads']} thread, median of {pl['reps']} timed calls after "
            f"{pl['warmup']} warm-up calls; forward + backward of one layer (weight, bias and input gradients); "
            "`engine` is `PerSampleEngine` (layer-wise) with the path its cost model chose, `engine_ghost` / "
            "`engine_inst` / `engine_reuse` force the ghost norm / the instantiated norm (each then a clipped "
            "matmul) / instantiate-and-reuse; `proto_inst_reuse` is the earlier benchmark-side prototype of the "
            "last; `engine_generic` the engine with the layer's dedicated rule unregistered, so the generic rule "
            "clips it; `func` torch.func vmap(grad) + "
            "clipping; `naive` one backward per example. Memory: " + pl["memory_method"] + ". The floor is "
            "1 + min(T(d+p), d·p)/(3·d·p). Every DP method's clipped gradient matched `func`'s (max relative "
            f"error {max(v.get('max_rel_err_vs_func', 0) for c in pl['cases'] for v in c['methods'].values()):.1e})."
            " The token-major rows are blocks of several layers given the examples' tokens as rows "
            "(`benchmarks/per_layer_token.py`), clipped all-layer as the references are; where vmap cannot batch "
            "an MoE's data-dependent routing, `naive` is the reference (max relative error "
            f"{max([v.get('max_rel_err_vs_naive', 0) for c in pl['cases'] for v in c['methods'].values()] + [0]):.1e})."
            + "".join(f" The rows {'; '.join(m['cases'])} are from a later run with the same settings (each row's "
                      "ratios come from one run)." for m in pl.get("merged_runs", [])),
            "",
            per_layer.render(pl),
        ]
    if rnn:
        errs = {name: max(v.get(k, 0) for c in rnn["cases"] for n, v in c["methods"].items() if n == name
                          for k in ("max_rel_err_vs_func", "max_rel_err_vs_naive")) for name in ("engine", "opacus")}
        parts += [
            "### RNNs and EmbeddingBag",
            "",
            f"`python -m benchmarks.per_layer --set rnn`, a separate run with the same settings (batch {rnn['batch']}, "
            f"{rnn['threads']} thread, median of {rnn['reps']} calls after {rnn['warmup']} warm-up calls). The "
            "layer is the user's `nn.LSTM` / `nn.GRU` / `nn.EmbeddingBag` (1-D indices with offsets); `engine` "
            "recomputes the recurrence unrolled in time in its backward (PyTorch's fused kernels give no per-step "
            "gradients); `opacus` is Opacus 1.6 as its users run these layers (`DPLSTM` / `DPGRU` in place of "
            "the layer, `GradSampleModule`); `func` is missing where vmap cannot batch the layer, and `naive` "
            "(one backward per example) is then the reference. Max relative error against the reference: engine "
            f"{errs['engine']:.1e}, opacus {errs['opacus']:.1e} (Opacus' EmbeddingBag per-example gradient counts an "
            "index repeated within a bag once).",
            "",
            per_layer.render(rnn),
        ]
    return "\n".join(parts) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--skip-per-layer", action="store_true")
    ap.add_argument("--skip-step-time", action="store_true")
    ap.add_argument("--skip-profile", action="store_true", help="skip benchmarks.profile_engine (about a minute)")
    ap.add_argument("--skip-epsilon", action="store_true", help="skip benchmarks/epsilon_accuracy.py (~1.5 min)")
    ap.add_argument("--skip-scaling", action="store_true",
                    help="skip benchmarks.scaling (16 min predicted on 2 idle cores; 45 on a shared machine)")
    ap.add_argument("--skip-largest", action="store_true",
                    help="skip benchmarks.largest_model (about 40 trials of 30-70 s)")
    ap.add_argument("rest", nargs="*", help="flags for benchmarks.step_time, after --")
    args = ap.parse_args(argv)
    pl_path, st_path = RESULTS / "per_layer_cpu.json", RESULTS / "step_time_cpu.json"
    rnn_path = RESULTS / "per_layer_rnn_cpu.json"
    t0 = time.time()
    if not args.render_only:
        if any(os.environ.get(k) != v for k, v in STEADY_MALLOC.items()):
            # glibc reads these when the process starts: the in-process benchmarks (per-layer, engine profile)
            # get them by running this command again with them set; launched workers get them from benchmarks.launch
            os.execve(sys.executable, [sys.executable, "-m", "benchmarks.run",
                                       *(sys.argv[1:] if argv is None else argv)], {**os.environ, **STEADY_MALLOC})
        print("load average before:", load_average(), flush=True)
        if not args.skip_per_layer:
            per_layer.main(["--out", str(pl_path)])
            per_layer.main(["--set", "rnn", "--out", str(rnn_path)])
        if not args.skip_profile:
            profile_engine.main(["--layers-too", "--out", str(RESULTS / "profile_engine_cpu.json")])
        if not args.skip_step_time:
            step_time.main(args.rest + ["--out", str(st_path)])
        if not args.skip_epsilon:
            epsilon_accuracy.main(["--no-fixed", "--out", str(RESULTS / "epsilon_accuracy.json")])
        if not args.skip_scaling:
            scaling.main(["--out", str(RESULTS / "scaling_cpu.json")])
        if not args.skip_largest:
            # ZeRO-3 with offload in a search of its own, which adds two-pass clipping (not searched twice)
            largest_model.main(["--stages", "0,1,2,3", "--out", str(RESULTS / "largest_model_cpu.json")])
            largest_model.main(["--stages", "3o", "--methods", "nondp,layer,all,all-2pass",
                                "--out", str(RESULTS / "largest_model_offload_cpu.json")])
        print(f"total {time.time() - t0:.0f} s; load average after: {load_average()}", flush=True)
    pl = json.loads(pl_path.read_text()) if pl_path.exists() else None
    st = json.loads(st_path.read_text()) if st_path.exists() else None
    rnn = json.loads(rnn_path.read_text()) if rnn_path.exists() else None
    if st:
        plot(st, PNG)
    command = "python -m benchmarks.run" + (" -- " + " ".join(args.rest) if args.rest else "")
    if args.render_only and st and st.get("command"):
        command = st["command"]
    METHOD_DOC.write_text(render_doc(pl, st, command, rnn))
    if st:
        DOC.write_text(render_summary(st, _load(RESULTS / "step_time_gpu.json"), f"../benchmarks/results/{PNG.name}",
                                      _load(RESULTS / "op_count.json")))
    print(f"wrote {METHOD_DOC.relative_to(ROOT)}" + (f", {DOC.relative_to(ROOT)} and {PNG.relative_to(ROOT)}"
                                                     if st else ""))


if __name__ == "__main__":
    main()
