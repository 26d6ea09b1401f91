"""What ``benchmarks.run`` writes in words: the summary, the model line and the performance targets.

Every target is read from one committed results file per benchmark (``step_time_cpu.json``,
``scaling_cpu.json``, ``largest_model_cpu.json``, ``epsilon_accuracy.json``); a target whose run is
missing from the results says so in its row instead of a verdict.
"""

from __future__ import annotations

from benchmarks.common import LARGEST_DP_METHODS, md_table

TARGET_NOTES = """\
The project's performance targets against what was measured (time ratios are CPU-time ratios to a non-DP
baseline of the same model, stage and batch measured in the same run; the wall-clock ratio is beside them).
"floor" is 1 + min(T(d+p), d·p)/(3·d·p) per Linear, FLOP-weighted over the model: the cost of a per-example
norm pass on top of the layer's forward and backward. Layer-wise clipping can go below it where the
engine's cost model picks instantiate-and-reuse (per-example gradients formed once, reused for the clipped
sum: no second matmul); all-layer sites spanning layers never reuse, so for them the floor is the bound
to approach. Memory growth is measured two ways, per process: the peak of the PyTorch allocator's live bytes
during one optimizer step above those live when it starts (the profiler's memory record, on a step after the
timed ones: deterministic, and the one the verdict uses), and the peak RSS minus the RSS when training starts
(which also counts the C allocator's cached and fragmented memory)."""

NOT_RUN = "not in this run"


def _get(st: dict | None, name: str) -> dict:
    return next((r for r in (st or {}).get("results", []) if r["name"] == name and "error" not in r), {})


def cpu_ratio(r: dict) -> float:
    """A configuration's CPU-time ratio to its baseline: from the interleaved steps where they ran (DP and its
    baseline taking turns in the same processes, which the machine's drifting speed cannot tell apart), else
    from the separate launches."""
    return r.get("paired_cpu_ratio", r.get("cpu_ratio", float("nan")))


def _measured(r: dict) -> str:
    q = r.get("paired_cpu_quartiles")
    return f"{cpu_ratio(r):.3f}" + (f" (quartiles {q[0]:.2f}–{q[1]:.2f})" if q else "")


def _verdict(ok: bool | None) -> str:
    return "–" if ok is None else ("met" if ok else "**missed**")


def targets(st: dict | None, scaling: dict | None = None, largest: dict | list | None = None,
            eps: dict | None = None, gpu: dict | None = None) -> str:
    """One row per target and measured configuration: target, bound, measured, wall-clock ratio, floor,
    verdict."""
    rows = []
    facts = (st or {}).get("facts", {})

    def time_row(label, name, bound, floor=None, rel=None):
        r = _get(st, name)
        if not r or "cpu_ratio" not in r:
            rows.append([label, rel or f"≤ {bound:.3f}", NOT_RUN, None, None if floor is None else f"{floor:.3f}", "–"])
            return
        wall = r.get("paired_time_ratio", r["time_ratio"])
        rows.append([label, rel or f"≤ {bound:.3f}", _measured(r), f"{wall:.3f}",
                     None if floor is None else f"{floor:.3f}", _verdict(cpu_ratio(r) <= bound)])

    def gpt_words(model):
        a = (st or {}).get("args", {})
        if model == "gpt-wide":
            return (f"GPT d {a.get('wide_d_model', 768)} (T {a.get('wide_seq', 256)}, {a.get('wide_layers', 2)} "
                    f"blocks, micro-batch {a.get('wide_batch', 4)})")
        return (f"GPT d {a.get('d_model', 256)} (T {a.get('seq', 128)}, {a.get('layers', 4)} blocks, "
                f"micro-batch {a.get('batch', 8)})")

    # 1. all-layer and layer-wise clipping at the floor on ZeRO-2/3, at two widths
    for method, words in (("all", "all-layer"), ("layer", "layer-wise")):
        for model in ("gpt", "gpt-wide"):
            floor = facts.get(model, {}).get("floor")
            for s in (2, 3):
                time_row(f"{words}, {gpt_words(model)}, ZeRO-{s}", f"{model}/zero{s}/{method}",
                         (floor or float("nan")) + 0.03, floor, "≤ floor + 0.03")
    # 2. the CNN: one process against Opacus' hooks, and ZeRO-3
    ours, hooks = _get(st, "cnn/1proc/ours-layer"), _get(st, "cnn/1proc/opacus-hooks")
    if ours and hooks:
        ok = cpu_ratio(ours) <= 1.2 and cpu_ratio(ours) < cpu_ratio(hooks)
        rows.append(["CNN layer-wise, one process, and below Opacus 1.6 hooks in the same run",
                     "≤ 1.2 and < Opacus hooks", f"{_measured(ours)}; Opacus hooks {cpu_ratio(hooks):.3f}",
                     f"{ours.get('paired_time_ratio', ours['time_ratio']):.3f}", None, _verdict(ok)])
    else:
        rows.append(["CNN layer-wise, one process, and below Opacus 1.6 hooks in the same run",
                     "≤ 1.2 and < Opacus hooks", NOT_RUN, None, None, "–"])
    cf = facts.get("cnn", {}).get("floor")
    time_row("CNN layer-wise, ZeRO-3", "cnn/zero3/layer", (cf or float("nan")) + 0.1, cf, "≤ floor + 0.1")
    # 3. LoRA
    time_row("LoRA adapters, layer-wise, ZeRO-2", "gpt-lora/zero2/layer", 1.03, facts.get("gpt-lora", {}).get("floor"))
    # 4. memory of all-layer clipping: book-keeping (one backward) and two passes (the norms first)
    all_rows = [r for r in (st or {}).get("results", []) if r.get("method") in ("all", "all-2pass")
                and r.get("kind") == "lightning" and "rss_growth_ratio" in r]
    for r in sorted(all_rows, key=lambda r: (r["method"], r["name"])):
        mode = "two-pass" if r["method"] == "all-2pass" else "book-keeping"
        # the allocator's peak during a step where it was measured (deterministic), else the RSS growth
        alloc = r.get("alloc_step_peak_ratio")
        growth = alloc if alloc is not None else r["rss_growth_ratio"]
        measured = (f"step peak ×{alloc:.3f}; RSS growth ×{r['rss_growth_ratio']:.3f}" if alloc is not None
                    else f"RSS growth ×{r['rss_growth_ratio']:.3f}")
        rows.append([f"all-layer peak memory growth, {mode}, {r.get('group', r['name'])}", "≤ 1.10",
                     f"{measured} (its time: {_measured(r)})", None, None,
                     _verdict(growth <= 1.10) + f" (absolute peak RSS ×{r['rss_peak_ratio']:.3f})"])
    if not all_rows:
        rows.append(["all-layer peak memory growth", "≤ 1.10", NOT_RUN, None, None, "–"])
    # 5. accounting
    if eps:
        w = eps["worst_relative_excess"]
        rows.append([f"reported ε against the tightest valid bound ({eps['settings']} reference settings, ε ≥ 0.01)",
                     "≤ 1 % above", f"{100 * w:.2f} % (worst)", None, None, _verdict(w <= 0.01)])
    else:
        rows.append(["reported ε against the tightest valid bound", "≤ 1 % above", NOT_RUN, None, None, "–"])
    # 6. scaling
    if scaling:
        done = [r for r in scaling["results"] if "error" not in r]
        a = scaling["args"]
        grid = 3 * len(a["widths"]) * len(a["seqs"]) * len(a["batches"])  # non-DP, layer-wise, all-layer
        rows.append(["cost against width, length and batch (ZeRO-3; table below)", "measured",
                     f"{len(done)} of {grid} configurations", None, None, _verdict(len(done) == grid)])
    else:
        rows.append(["cost against width, length and batch", "measured", NOT_RUN, None, None, "–"])
    # 7. the largest model (one search, or several: a later one may search a stage again, with more methods)
    runs = [lm for lm in (largest if isinstance(largest, list) else [largest]) if lm]
    searched: set[str] = set()
    for lm in runs:
        budget = lm["args"]["budget_mb"]
        for c in lm["configs"]:
            later = ", a later search" if c["label"] in searched else ""
            searched.add(c["label"])
            nd = c["results"].get("nondp")
            for m, words in LARGEST_DP_METHODS.items():
                r = c["results"].get(m)
                if not nd or m not in c["results"]:
                    continue
                v = r["psi"] / nd["psi"] if r else 0.0
                rows.append([f"largest model, {words} against non-DP, {c['label']}, {budget:.0f} MB per process{later}",
                             "≥ 0.95 of non-DP's Ψ", f"{v:.3f}" + (f" ({r['psi'] / 1e6:.1f} M / {nd['psi'] / 1e6:.1f} M)"
                                                              if r else " (nothing fits)"),
                             None, None, _verdict(v >= 0.95)])
    if not runs:
        rows.append(["largest model that fits, DP against non-DP", "≥ 0.95 of non-DP's Ψ", NOT_RUN, None, None, "–"])
    # 8. GPU
    if gpu:  # wall-clock ratios of the first run that measured each configuration (section *On a GPU*)
        from benchmarks.gpu import first_measured

        got = {n: r.get("time_ratio") for n, r in first_measured(gpu).items()}
        shown = {"ZeRO-3 all-layer": "gpt/zero3/all", "ZeRO-3 layer-wise": "gpt/zero3/layer",
                 "one process all-layer": "gpt/1proc/ours-all", "Opacus hooks": "gpt/1proc/opacus-hooks"}
        text = ", ".join(f"{k} {got[n]:.2f}×" for k, n in shown.items() if got.get(n))
        rows.append([f"the same figures on a GPU ({gpu['runs'][0]['machine_before'].get('gpu')}, GPT d 768)",
                     "measured", f"measured (section *On a GPU*): {text}; fp16 DP not yet", None,
                     gpu["runs"][0]["facts"]["gpt"]["floor"], "measured"])
    else:
        rows.append(["the same figures on a GPU", "measured", "not measured (no GPU in this run); `benchmarks/gpu.sh` "
                     "runs them", None, None, "–"])
    return md_table(["target", "bound", "measured (CPU time ratio / RSS growth ratio)", "wall-clock ratio", "floor",
                     "verdict"],
                    rows)


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}×" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}×"


#: how the summary names the models and clipping methods of ``benchmarks.step_time``
_MODEL_WORDS = {"gpt": "GPT-style decoder", "gpt-wide": "The decoder at GPT-2-small width",
                "gpt-lora": "The same decoder with LoRA adapters", "cnn": "Small CNN"}
_METHOD_WORDS = {"layer": "layer-wise clipping (the default)", "all": "all-layer clipping (book-keeping)",
                 "all-2pass": "all-layer clipping, two passes (`clipping_mode=\"two-pass\"`)",
                 "group": "group-wise clipping", "layer-auto": "layer-wise clipping, automatic function"}
_SINGLE_WORDS = {"ours-layer": "lightning-dpzero's engine layer-wise", "ours-all": "lightning-dpzero's engine all-layer",
                 "opacus-hooks": "Opacus 1.6 hooks", "opacus-ghost": "Opacus 1.6 ghost clipping",
                 "naive": "a backward per example", "func": "torch.func vmap(grad)"}


def _count(n: int) -> str:
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"


def summary(st: dict) -> str:
    """What DP costs against non-DP, per model and clipping method, in words (from the step-time JSON)."""
    ok = [r for r in st["results"] if "error" not in r and "cpu_ratio" in r and r["method"] != "nondp"]
    lines = [
        "What DP-SGD costs against the same training without DP, measured on "
        f"{st['machine_before'].get('cpu_count')} CPU cores: the CPU time of one optimizer step and the peak "
        "memory of a process, each as a ratio to non-DP training of the same model, ZeRO stage and batch "
        "(1.20× = 20% more). The time ratios come from DP and non-DP steps taken in turn in the same processes "
        "(the median over the rounds): on this shared machine a core's speed drifts by up to 2× within "
        "seconds, so two separate runs a minute apart differ by up to ±0.4 in a ratio, while steps taken in "
        "turn see the same speed (*Reading the results* below). "
        + ("Every timed process keeps its freed memory (glibc's allocator settings under *Machine*), so no step "
           "pays page faults that depend on what the process ran before." if st.get("malloc_env") else
           "Steps also pay page faults, as PyTorch's CPU allocator returns memory to the system and takes it "
           "back, and how many depends on what the process ran before: on the small CNN that moved a ratio by "
           "up to 0.2 (*Against the targets* below)."),
        "",
    ]
    for model in ("gpt", "gpt-wide", "gpt-lora", "cnn"):
        rows = [r for r in ok if r["model"] == model and r["kind"] == "lightning"]
        if not rows:
            continue
        fact = st["facts"][model]
        size = f"{_count(fact['psi'])} parameters" + (f", {_count(fact['psi_trainable'])} trainable"
                                                     if fact["psi_trainable"] != fact["psi"] else "")
        lines.append(f"* **{_MODEL_WORDS.get(model, model)}** ({size}), Lightning + DeepSpeed, "
                     f"{rows[0]['world']} processes:")
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == method]
            stages = "/".join(str(r["stage"]) for r in mine)
            lines.append(f"    * {_METHOD_WORDS.get(method, method)}, ZeRO-{stages}: "
                         f"{_span([cpu_ratio(r) for r in mine])} the time, "
                         f"{_span([r['rss_peak_ratio'] for r in mine])} the peak memory")
    for model in ("gpt", "cnn"):
        rows = [r for r in ok if r["model"] == model and r["kind"] == "single"]
        if rows:
            lines.append(f"* **{_MODEL_WORDS[model]}, one process** (a plain PyTorch loop, no DeepSpeed), the time "
                         "against non-DP: " + "; ".join(f"{_SINGLE_WORDS.get(r['method'], r['method'])} "
                                                        f"{cpu_ratio(r):.2f}×" for r in rows) + ".")
    lines += [
        "",
        "Layer-wise clipping adds the least memory: each layer clips inside its own backward. All-layer and "
        "group-wise clipping keep every layer's output gradients until the end of the backward pass, unless "
        "`clipping_mode=\"two-pass\"`, which keeps nothing and pays for a second backward pass instead. Which "
        "style is faster depends on the model's layers (compare the rows above). Small models with short "
        "steps pay relatively more for the fixed work of a DP step (accounting, per-layer book-keeping). These "
        "are CPU measurements; the section *On a GPU* has the first GPU figures.",
    ]
    return "\n".join(lines)


def model_line(a: dict, f: dict) -> str:
    """One sentence describing the benchmarked models."""
    parts = []
    if "gpt" in f:
        g = (f"GPT-style decoder: vocab {a['vocab']}, d_model {a['d_model']}, {a['heads']} heads, {a['layers']} "
             f"blocks, T {a['seq']}, Ψ = {f['gpt']['psi']:,} parameters")
        if "gpt-lora" in f:
            g += f"; with LoRA rank {a['lora_rank']} on q and v, {f['gpt-lora']['psi_trainable']:,} trainable"
        parts.append(g)
    if "gpt-wide" in f:
        parts.append(f"The same decoder at GPT-2-small width (gpt-wide): d_model {a['wide_d_model']}, {a['wide_heads']} "
                     f"heads, {a['wide_layers']} blocks, T {a['wide_seq']}, Ψ = {f['gpt-wide']['psi']:,}")
    if "cnn" in f:
        parts.append(f"CNN: 3 Conv2d+GroupNorm+ReLU stages ({a['cnn_channels']}, {2 * a['cnn_channels']}, "
                     f"{2 * a['cnn_channels']} channels, 32×32 inputs) and a Linear head, Ψ = {f['cnn']['psi']:,}")
    return ". ".join(parts) + "."

