"""Where the per-example engine spends its time: torch.profiler over GPT forward + backward steps.

Runs one process, one thread, the GPT of ``benchmarks.models`` (d 256, T 128, 4 blocks by default) at
micro-batch ``--batch``, forward + backward only (no optimizer, no DeepSpeed), in three modes: non-DP,
``PerSampleEngine`` layer-wise and all-layer. Inside this process only, every rule method and the engine's
backward entry points are wrapped in ``torch.profiler.record_function`` labels (``dpzero.Class.method``,
named after the class that defines the method: Conv2d's norms run in ``LinearRule.norm_sq``),
so the profile attributes time to them without touching ``lightning_dpzero``. Prints, per mode, the
step time and its ratio to non-DP, the engine labels' inclusive times per step, and the top aten
operators by self time; with ``--layers-too`` the same for each case of ``benchmarks.per_layer``; writes ``benchmarks/results/profile_engine_cpu.json``.

Usage::

    python -m benchmarks.profile_engine [--batch 8] [--steps 3] [--threads 1] [--d-model 256] [--layers-too]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from benchmarks.common import RESULTS, machine_info, md_table, median, quiet_stderr, write_json
from benchmarks.models import build_model, loss_fn, make_data

def instrument() -> None:
    """Wrap rule methods and engine entry points in record_function labels (this process only)."""
    from lightning_dpzero.per_sample import engine as engine_mod
    from lightning_dpzero.per_sample import registry
    from lightning_dpzero.per_sample import sums as sums_mod

    def wrap(owner, name, label):
        fn = owner.__dict__.get(name)
        if fn is None or getattr(fn, "_dpzero_wrapped", False):
            return

        @functools.wraps(fn)
        def wrapped(*a, **k):
            with torch.profiler.record_function(label):
                return fn(*a, **k)

        wrapped._dpzero_wrapped = True
        setattr(owner, name, wrapped)

    seen = set()
    for rule in (*registry.RULES.values(), *registry.NAMED_RULES.values()):
        for cls in type(rule).__mro__:  # each method labelled by the class that defines it
            if cls in seen or cls is object:
                continue
            seen.add(cls)
            for meth in ("grad_input", "norm_sq", "clipped_grads", "add_clipped_grads", "per_example", "_rows",
                         "_per_example", "_segments", "_native", "forward"):
                wrap(cls, meth, f"dpzero.{cls.__name__}.{meth}")
    for meth in ("_on_backward", "_complete", "finalize", "_forward"):
        wrap(engine_mod.PerSampleEngine, meth, f"dpzero.engine.{meth}")
    for fn in ("clipped", "write_clipped"):  # a completed group's clipped sums (module functions)
        wrap(sums_mod, fn, f"dpzero.sums.{fn}")


def instrument_strategy() -> None:
    """:func:`instrument` plus the strategy's other per-step work: the noise pre-hook, the ledger charge,
    the accountant callback's per-step ε update, and the loss probe."""
    instrument()
    from lightning_dpzero.lightning import callback as cb_mod
    from lightning_dpzero import mechanism as mech_mod
    from lightning_dpzero.lightning import strategy as strat_mod

    original = mech_mod.make_noise_pre_hook

    def make_hook(*a, **k):
        hook = original(*a, **k)

        def labelled(*ha, **hk):
            with torch.profiler.record_function("dpzero.noise_pre_hook"):
                return hook(*ha, **hk)

        return labelled

    mech_mod.make_noise_pre_hook = make_hook
    for owner, meth, label in ((cb_mod.PrivacyAccountantCallback, "on_train_batch_end", "dpzero.accountant.on_train_batch_end"),
                               (mech_mod.DPMechanism, "_on_loss_grad", "dpzero.mechanism._on_loss_grad"),
                               (strat_mod.DPDeepSpeedStrategy, "optimizer_step", "dpzero.strategy.optimizer_step"),
                               (strat_mod.DPDeepSpeedStrategy, "backward", "dpzero.strategy.backward")):
        fn = owner.__dict__.get(meth)
        if fn is None:
            continue

        def wrapped(*a, _fn=fn, _label=label, **k):
            with torch.profiler.record_function(_label):
                return _fn(*a, **k)

        setattr(owner, meth, wrapped)


def summarize(prof, steps: int, top: int = 20) -> dict:
    """Per-step inclusive ms of every ``dpzero.*`` label, the profiled step time, and the top operators
    by self time (ms per step).

    With the GPU profiled too (``ProfilerActivity.CUDA``), also: the GPU's busy time per step (the sum of its
    kernels' times) and its kernel launches per step, each label's GPU time (the kernels launched inside it),
    and the top kernels by GPU time. A step whose host time is far above its kernels' time is bound by the
    host (Python and kernel launches), not by the GPU's arithmetic."""
    from torch.autograd import DeviceType

    ka = prof.key_averages()
    labels = {e.key: e.cpu_time_total / steps / 1e3 for e in ka if e.key.startswith("dpzero.")}
    step_ms = next((e.cpu_time_total / steps / 1e3 for e in ka if e.key == "step"), float("nan"))
    kernels = [e for e in ka if e.device_type == DeviceType.CUDA]
    ops = sorted(((e.key, e.self_cpu_time_total / steps / 1e3, e.count // steps) for e in ka
                  if not e.key.startswith("dpzero.") and e.key != "step" and e.device_type != DeviceType.CUDA),
                 key=lambda t: -t[1])[:top]
    out = {"profiled_step_ms": step_ms, "labels_ms": dict(sorted(labels.items(), key=lambda t: -t[1])),
           "top_ops": ops}
    if kernels:
        out["device_ms_per_step"] = sum(e.self_device_time_total for e in kernels) / steps / 1e3
        out["kernels_per_step"] = sum(e.count for e in kernels) / steps
        out["labels_device_ms"] = {e.key: e.device_time_total / steps / 1e3 for e in ka
                                   if e.key.startswith("dpzero.")}
        out["top_kernels"] = sorted(((e.key[:80], e.self_device_time_total / steps / 1e3, e.count / steps)
                                     for e in kernels), key=lambda t: -t[1])[:top]
    return out


def run_mode(mode: str, args) -> dict:
    torch.manual_seed(0)
    kw = dict(d_model=args.d_model, heads=args.heads, layers=args.layers, seq=args.seq, vocab=args.vocab)
    model = build_model("gpt", **kw)
    x, y = make_data("gpt", args.batch, seed=1, **kw)
    eng = None
    if mode != "nondp":
        from lightning_dpzero.per_sample import PerSampleEngine

        eng = PerSampleEngine(model, 1.0, "layer-wise" if mode == "layer" else "all-layer").attach()

    def step():
        for p in model.parameters():
            p.grad = None
        if eng is None:
            loss_fn(model(x), y).backward()
        else:
            with eng.micro_batch(batch_size=args.batch):
                loss_fn(model(x), y).backward()

    for _ in range(args.warmup):
        step()
    times = []
    clock = time.thread_time if args.threads == 1 else time.process_time  # CPU time: robust to other jobs
    for _ in range(max(args.steps, 5)):
        t0 = clock()
        step()
        times.append(clock() - t0)
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            with torch.profiler.record_function("step"):
                step()
    ka = prof.key_averages()
    n = args.steps
    labels = {e.key: e.cpu_time_total / n / 1e3 for e in ka if e.key.startswith("dpzero.")}
    step_ms = next((e.cpu_time_total / n / 1e3 for e in ka if e.key == "step"), float("nan"))
    ops = sorted(((e.key, e.self_cpu_time_total / n / 1e3, e.count // n) for e in ka
                  if not e.key.startswith("dpzero.") and e.key != "step"), key=lambda t: -t[1])[:args.top]
    return {"mode": mode, "median_ms": 1e3 * median(times), "profiled_step_ms": step_ms,
            "labels_ms": dict(sorted(labels.items(), key=lambda t: -t[1])), "top_ops": ops}


def profile_layers(args) -> dict:
    """Per-layer cases of ``benchmarks.per_layer`` (batch ``--batch``): non-DP and engine, labels and top ops."""
    from benchmarks import per_layer
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for case in per_layer.CASES:
        label = per_layer.case_label(case)
        row = {}
        for name, make in (("nondp", per_layer.m_nondp), ("engine", per_layer.m_engine)):
            layer, x, R = per_layer.make_case(case, args.batch)
            step = make(layer, x, R)
            for _ in range(args.warmup):
                step()
            with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    with torch.profiler.record_function("step"):
                        step()
            ka, n = prof.key_averages(), args.steps
            step_ms = next((e.cpu_time_total / n / 1e3 for e in ka if e.key == "step"), float("nan"))
            row[name] = {"step_ms": step_ms,
                         "labels_ms": {e.key: e.cpu_time_total / n / 1e3 for e in ka if e.key.startswith("dpzero.")},
                         "top_ops": sorted(((e.key, e.self_cpu_time_total / n / 1e3, e.count // n) for e in ka
                                            if not e.key.startswith("dpzero.") and e.key != "step"),
                                           key=lambda t: -t[1])[:8]}
        out[label] = row
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--modes", default="nondp,layer,all")
    ap.add_argument("--layers-too", action="store_true", help="also profile the per-layer cases (batch --batch)")
    ap.add_argument("--out", default=str(RESULTS / "profile_engine_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    instrument()
    res = {"args": vars(args), "machine_before": machine_info(), "modes": {}}
    for mode in args.modes.split(","):
        res["modes"][mode] = run_mode(mode, args)
    if args.layers_too:
        res["layers"] = profile_layers(args)
    res["machine_after"] = machine_info()
    write_json(args.out, res)
    print(render(res))
    return res


def render(res: dict) -> str:
    modes = res["modes"]
    base = modes.get("nondp", {}).get("median_ms")
    out = [md_table(["mode", "fwd+bwd CPU ms (median)", "× non-DP", "profiled wall ms/step"],
                    [[m, r["median_ms"], r["median_ms"] / base if base else None, r["profiled_step_ms"]]
                     for m, r in modes.items()])]
    for m, r in modes.items():
        if r["labels_ms"]:
            out.append(f"**{m}: engine functions, inclusive ms per step**\n\n"
                       + md_table(["label", "ms/step", "% of step"],
                                  [[k, v, 100 * v / r["profiled_step_ms"]] for k, v in r["labels_ms"].items()]))
        out.append(f"**{m}: top operators by self time, ms per step**\n\n"
                   + md_table(["operator", "self ms/step", "calls/step"], r["top_ops"]))
    for label, row in res.get("layers", {}).items():
        e, nd = row["engine"], row["nondp"]
        out.append(f"**{label}**: non-DP {nd['step_ms']:.2f} ms, engine {e['step_ms']:.2f} ms "
                   f"(×{e['step_ms'] / nd['step_ms']:.2f})\n\n"
                   + md_table(["engine label", "ms/call"], sorted(e["labels_ms"].items(), key=lambda t: -t[1])[:8])
                   + "\n\n" + md_table(["engine: operator", "self ms", "calls"], e["top_ops"][:6])
                   + "\n\n" + md_table(["non-DP: operator", "self ms", "calls"], nd["top_ops"][:3]))
    return "\n\n".join(out) + "\n"


if __name__ == "__main__":
    main()
