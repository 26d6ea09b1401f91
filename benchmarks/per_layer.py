"""Per-layer micro-benchmark (issue #3): one layer's forward + backward, non-DP against per-example clipping.

For each layer shape, in one process and one run:

* ``nondp``      plain forward + backward (weight, bias and input gradients);
* ``engine``     our ``PerSampleEngine`` (layer-wise clipping), with the path its cost model chooses for these
                 shapes (``paths.choose_path``; "engine chose" is the path the engine recorded in
                 ``engine.last_paths``), and, for Linear and Conv2d, each path forced (``engine_ghost``: ghost
                 norm + clipped matmul, ``engine_inst``: instantiated norm + clipped matmul, ``engine_reuse``:
                 instantiate and reuse) by replacing ``paths.use_ghost``/``paths.use_reuse`` inside this
                 process only;
* ``engine_generic`` (normalisation layers and the custom layer) the engine with the layer's dedicated rule
                 unregistered for this process, so the generic rule (torch.func over the layer's own forward,
                 ``per_sample/generic.py``) clips it: its cost beside the dedicated rule's;
* ``func``       ``torch.func.vmap(grad)`` per-example gradients (parameters and input), then clipping and
                 the weighted sum;
* ``naive``      one forward + ``autograd.grad`` per example, then clipping and the sum;
* ``opacus``     (RNNs, EmbeddingBag) Opacus 1.6: ``DPLSTM``/``DPGRU`` in place of the layer, ``GradSampleModule``
                 per-example gradients, then clipping and the sum;
* ``proto_inst_reuse`` (Linear only) the benchmark-side prototype that preceded ``engine_reuse``: per-example
                 gradients instantiated once in the layer's backward and reused for the clipped sum (see
                 ``_InstReuseLinear``), kept as the lower bound the engine's path is compared with.

Every method computes the same things: the sum of clipped per-example parameter gradients (plain sum for
``nondp``) and the input gradient. Each example's loss is ``Σ out_i ⊙ R_i`` for a fixed random ``R``; the
batch loss is their mean. Time: median of ``--reps`` timed calls after ``--warmup`` calls (methods
timed round-robin), as CPU time of the calling thread (``time.thread_time``; with one torch thread all
the work runs there, and time the OS gave to other jobs on a shared machine is excluded; wall-clock
medians are in the JSON too), and the ratio to ``nondp`` measured in the same run. Memory: the peak of live torch CPU tensor bytes during one call,
from ``torch.profiler`` memory events (``profile_memory=True``), above what was live before the call
(inputs and parameters excluded). Each DP method's clipped gradient is checked against ``func``'s.

Usage::

    python -m benchmarks.per_layer [--reps 10] [--warmup 3] [--threads 1] [--batch 16] [--quick] [--set core|rnn] [--layers lstm,gru]
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from benchmarks.common import RESULTS, machine_info, md_table, median, profiler_peak_bytes, write_json
from benchmarks.per_layer_rnn import FirstOutput, Bags, m_opacus
from benchmarks.per_layer_token import KINDS as TOKEN_KINDS, make_token_case, token_label

C = 1.0  # clipping threshold (every example is clipped at these scales)
#: CPU clock of the timings: the calling thread's with one torch thread, else the whole process's
CLOCK = time.thread_time

#: (layer, shape) cases; for Linear the engine's rule is ghost when 2T² < p·d
CASES = [
    dict(layer="linear", T=16, d=512, p=512, note="short sequence, wide layer: ghost wins"),
    dict(layer="linear", T=128, d=256, p=256, note="GPT d 256 attention projection"),
    dict(layer="linear", T=128, d=256, p=1024, note="GPT d 256 MLP up-projection"),
    dict(layer="linear", T=128, d=768, p=768, note="GPT-2-small width projection"),
    dict(layer="linear", T=512, d=64, p=64, note="long sequence, narrow layer: instantiation wins"),
    dict(layer="conv2d", cin=16, cout=32, k=3, hw=32, note="early conv: T=1024 patches, instantiation wins"),
    dict(layer="conv2d", cin=64, cout=64, k=3, hw=8, note="late conv: T=64 patches, ghost wins"),
    dict(layer="embedding", T=128, vocab=1000, d=256, note="token embedding"),
    dict(layer="layernorm", T=128, d=256, note="LayerNorm(d)"),
    dict(layer="rmsnorm", T=128, d=256, note="nn.RMSNorm(d): dedicated rule"),
    dict(layer="hf_rmsnorm", T=128, d=256, note="HF LlamaRMSNorm(d): rule matched by class name"),
    dict(layer="custom", T=128, d=256, note="a user's gated scale layer: generic rule only"),
    # token-major blocks (per_layer_token.py): their layers get the examples' tokens as rows
    dict(layer="flat_ffn", clipping="all-layer", T=128, d=256, hidden=1024, note="OPT's feed-forward on x.reshape(-1, d)"),
    dict(layer="moe_generic", clipping="all-layer", T=128, d=256, hidden=512, experts=4, top_k=2, func=False, note="HF Mixtral block"),
    dict(layer="moe_linear", clipping="all-layer", T=128, d=256, hidden=512, experts=4, top_k=2, func=False, note="nn.Linear experts"),
]
#: cases timed with the generic rule too (engine_generic; the custom layer has only that one)
GENERIC_TOO = ("rmsnorm", "hf_rmsnorm")


class GatedScale(nn.Module):
    """A small custom layer no rule knows: ``x ⊙ sigmoid(x·u) ⊙ w`` with parameters ``w``, ``u`` of size d."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d) * 0.1 + 1)
        self.u = nn.Parameter(torch.randn(d) / d ** 0.5)

    def forward(self, x):
        return x * torch.sigmoid(x @ self.u).unsqueeze(-1) * self.w

#: the RNN and EmbeddingBag rows (``--set rnn``, ``per_layer_rnn_cpu.json``); the RNN rule unrolls the recurrence
#: in Python in its backward; vmap cannot batch GRU, a bidirectional LSTM or the bags (no func column)
RNN_CASES = [
    dict(layer="lstm", T=64, d=128, H=128, L=1, bi=False, func=True, note="LSTM, one layer"),
    dict(layer="lstm", T=32, d=64, H=64, L=2, bi=True, func=False, note="LSTM, 2 bidirectional layers"),
    dict(layer="gru", T=64, d=128, H=128, L=1, bi=False, func=False, note="GRU, one layer"),
    dict(layer="embedding_bag", vocab=1000, d=128, N=32, func=False, note="EmbeddingBag mean, 1-D + offsets"),
]


def make_case(case: dict, B: int, seed: int = 0):
    """The layer, its input ``x`` and output weights ``R`` for one case."""
    torch.manual_seed(seed)
    kind = case["layer"]
    if kind == "linear":
        layer = nn.Linear(case["d"], case["p"])
        x = torch.randn(B, case["T"], case["d"])
    elif kind == "conv2d":
        layer = nn.Conv2d(case["cin"], case["cout"], case["k"], padding=case["k"] // 2)
        x = torch.randn(B, case["cin"], case["hw"], case["hw"])
    elif kind == "embedding":
        layer = nn.Embedding(case["vocab"], case["d"])
        x = torch.randint(0, case["vocab"], (B, case["T"]))
    elif kind in ("layernorm", "rmsnorm", "hf_rmsnorm", "custom"):
        if kind == "hf_rmsnorm":
            from transformers.models.llama.modeling_llama import LlamaRMSNorm

            layer = LlamaRMSNorm(case["d"])
        else:
            layer = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm, "custom": GatedScale}[kind](case["d"])
        x = torch.randn(B, case["T"], case["d"])
    elif kind in ("lstm", "gru"):
        cls = nn.LSTM if kind == "lstm" else nn.GRU
        layer = FirstOutput(cls(case["d"], case["H"], num_layers=case["L"], bidirectional=case["bi"], batch_first=True))
        x = torch.randn(B, case["T"], case["d"])
    elif kind in TOKEN_KINDS:
        layer, x = make_token_case(case, B)
    elif kind == "embedding_bag":
        layer = Bags(nn.EmbeddingBag(case["vocab"], case["d"], mode="mean"))
        x = torch.randint(0, case["vocab"], (B, case["N"]))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        R = torch.randn_like(layer(x).float())
    return layer, x, R


def rows_shape(case: dict) -> tuple[int, int, int]:
    """(T, d, p) of the Linear view the engine uses (Conv2d: unfolded patches)."""
    if case["layer"] == "linear":
        return case["T"], case["d"], case["p"]
    if case["layer"] == "conv2d":
        return case["hw"] ** 2, case["cin"] * case["k"] ** 2, case["cout"]
    return 0, 0, 0


# ------------------------------------------------------------------------------------------ methods
def m_nondp(layer, x, R):
    params = [p for p in layer.parameters()]
    float_in = x.is_floating_point()

    def step():
        for p in params:
            p.grad = None
        xi = x.detach().requires_grad_(float_in)
        loss = (layer(xi) * R).sum() / x.shape[0]
        loss.backward()
        return {n: p.grad for n, p in layer.named_parameters()}, (xi.grad if float_in else None)

    return step


def m_engine(layer, x, R, force: str | None = None, clipping: str = "layer-wise"):
    from lightning_dpzero.per_sample import PerSampleEngine
    from lightning_dpzero.per_sample import paths, registry

    if force == "generic":  # the layer's dedicated rule unregistered while the engine attaches
        saved = dict(registry.RULES), dict(registry.NAMED_RULES)
        registry.RULES.pop(type(layer), None)
        for key in [k for k in registry.NAMED_RULES if k[1] == type(layer).__name__]:
            del registry.NAMED_RULES[key]
        try:
            eng = PerSampleEngine(layer, max_grad_norm=C, clipping=clipping).attach()
        finally:
            registry.RULES.clear(), registry.NAMED_RULES.clear()
            registry.RULES.update(saved[0]), registry.NAMED_RULES.update(saved[1])
        force = None
    else:
        eng = PerSampleEngine(layer, max_grad_norm=C, clipping=clipping).attach()
    float_in = x.is_floating_point()
    original = paths.use_ghost, paths.use_reuse
    forced = {None: original, "ghost": (lambda *a: True, lambda *a: False),
              "inst": (lambda *a: False, lambda *a: False), "reuse": (original[0], lambda *a: True)}[force]

    def step():
        for p in layer.parameters():
            p.grad = None
        xi = x.detach().requires_grad_(float_in)
        paths.use_ghost, paths.use_reuse = forced
        try:
            with eng.micro_batch(batch_size=x.shape[0]):
                loss = (layer(xi) * R).sum() / x.shape[0]
                loss.backward()
        finally:
            paths.use_ghost, paths.use_reuse = original
        return {n: p.grad for n, p in layer.named_parameters()}, (xi.grad if float_in else None)

    step.engine = eng
    return step


class _InstReuseLinear(torch.autograd.Function):
    """Prototype (benchmark only, not the engine): a Linear whose backward instantiates the per-example
    gradients once, ``G_i = g_iᵀ a_i`` (one ``bmm``, the same multiply-adds as the batch weight gradient),
    takes the norms from them and forms the clipped sum as ``Σ_i c_i G_i`` (``B·p·d`` multiply-adds), instead
    of a norm pass followed by a second full matmul. Layer-wise only (the coefficient is known in the
    layer's own backward); transient memory ``B·p·d``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        B = x.shape[0]
        gx = g.matmul(weight)
        gw = torch.bmm(g.transpose(1, 2), x).mul_(B)  # per-example gradients of the mean loss's terms
        gb = g.sum(1).mul_(B)
        norms = (gw.pow(2).sum((1, 2)) + gb.pow(2).sum(1)).sqrt()
        coef = (C / norms.clamp_min(1e-12)).clamp(max=1.0)
        return gx, torch.einsum("b,bpd->pd", coef, gw), coef @ gb


def m_proto(layer, x, R):
    """The instantiate-once prototype (:class:`_InstReuseLinear`), Linear only."""
    def step():
        layer.weight.grad = layer.bias.grad = None
        xi = x.detach().requires_grad_(True)
        loss = (_InstReuseLinear.apply(xi, layer.weight, layer.bias) * R).sum() / x.shape[0]
        loss.backward()
        return {"weight": layer.weight.grad, "bias": layer.bias.grad}, xi.grad

    return step


def _clip_sum(per: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per.values()))
    coef = (C / norms.clamp_min(1e-12)).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", coef, g) for n, g in per.items()}


def m_func(layer, x, R):
    params = {n: p.detach() for n, p in layer.named_parameters()}
    float_in = x.is_floating_point()

    def loss_one(prm, x1, r1):
        return (functional_call(layer, prm, (x1.unsqueeze(0),)) * r1.unsqueeze(0)).sum()

    per_example = vmap(grad(loss_one, argnums=(0, 1) if float_in else 0), in_dims=(None, 0, 0))

    def step():
        if float_in:
            gp, gx = per_example(params, x, R)
            gx = gx / x.shape[0]
        else:
            gp, gx = per_example(params, x, R), None
        return _clip_sum(gp), gx

    return step


def m_naive(layer, x, R):
    names = [n for n, _ in layer.named_parameters()]
    params = [p for _, p in layer.named_parameters()]
    float_in = x.is_floating_point()

    def step():
        total = {n: torch.zeros_like(p) for n, p in zip(names, params)}
        gxs = []
        for i in range(x.shape[0]):
            xi = x[i:i + 1].detach().requires_grad_(float_in)
            loss = (layer(xi) * R[i:i + 1]).sum()
            gs = torch.autograd.grad(loss, params + ([xi] if float_in else []))
            norm = torch.sqrt(sum(g.pow(2).sum() for g in gs[:len(params)]))
            c = (C / norm.clamp_min(1e-12)).clamp(max=1.0)
            for n, g in zip(names, gs):
                total[n].add_(g, alpha=float(c))
            if float_in:
                gxs.append(gs[-1] / x.shape[0])
        return total, (torch.cat(gxs) if float_in else None)

    return step


def run_case(case: dict, B: int, warmup: int, reps: int) -> dict:
    T, d, p = rows_shape(case)
    linear_like = case["layer"] in ("linear", "conv2d")
    # a block of several layers (token-major rows) is clipped all-layer, as the references clip (_clip_sum)
    clip = case.get("clipping", "layer-wise")
    methods: dict[str, Callable] = {"nondp": m_nondp, "engine": lambda l, x, r: m_engine(l, x, r, clipping=clip)}
    if linear_like:
        methods["engine_ghost"] = lambda l, x, r: m_engine(l, x, r, "ghost")
        methods["engine_inst"] = lambda l, x, r: m_engine(l, x, r, "inst")
        methods["engine_reuse"] = lambda l, x, r: m_engine(l, x, r, "reuse")
    if case["layer"] in GENERIC_TOO:
        methods["engine_generic"] = lambda l, x, r: m_engine(l, x, r, "generic")
    if case.get("func", True):
        methods["func"] = m_func
    methods["naive"] = m_naive
    if case["layer"] in ("lstm", "gru", "embedding_bag"):
        methods["opacus"] = lambda l, x, r: m_opacus(l, x, r, _clip_sum)
    if case["layer"] == "linear":
        methods["proto_inst_reuse"] = m_proto
    layer0, x, R = make_case(case, B)
    out = {"case": case, "B": B, "engine_choice": None, "methods": {}}
    if linear_like:
        out["T_d_p"] = [T, d, p]
        out["flop_cheaper"] = "ghost" if T * (d + p) < d * p else ("tie" if T * (d + p) == d * p else "instantiate")
        out["arithmetic_floor"] = 1.0 + min(T * (d + p), d * p) / (3.0 * d * p)
    steps = {}
    for name, make in methods.items():
        steps[name] = make(copy.deepcopy(layer0), x, R)
        for _ in range(warmup):
            steps[name]()
        if name == "engine":  # the paths the engine took, as it records them (None: the layer's rule is exact)
            out["engine_choice"] = " + ".join(sorted(set(steps[name].engine.last_paths.values()))) or None
        if name.startswith("engine") and not linear_like:  # which rule clipped the layer
            out.setdefault("rules", {})[name] = type(steps[name].engine.hooks[0].rule).__name__
    wall = {n: [] for n in steps}
    cpu = {n: [] for n in steps}
    for _ in range(reps):  # round-robin, so drift in the machine's load hits every method alike
        for name, step in steps.items():
            t0, c0 = time.perf_counter(), CLOCK()
            step()
            cpu[name].append(CLOCK() - c0)
            wall[name].append(time.perf_counter() - t0)
    ref = None
    for name, step in steps.items():
        peak = profiler_peak_bytes(step)
        grads, _ = step()
        res = {"median_ms": 1e3 * median(cpu[name]), "wall_median_ms": 1e3 * median(wall[name]),
               "cpu_ms": [1e3 * t for t in cpu[name]], "wall_ms": [1e3 * t for t in wall[name]],
               "peak_mb": peak / 2**20}
        if name == ("func" if "func" in steps else "naive"):  # the reference: func, else a backward per example
            ref = {k: v.detach().clone() for k, v in grads.items()}
            out["reference"] = name
        res["_grads"] = {k: v.detach().clone() for k, v in grads.items()}
        out["methods"][name] = res
    base = out["methods"]["nondp"]
    for name, res in out["methods"].items():
        g = res.pop("_grads")
        res["time_ratio"] = res["median_ms"] / base["median_ms"]
        res["wall_ratio"] = res["wall_median_ms"] / base["wall_median_ms"]
        res["mem_ratio"] = res["peak_mb"] / base["peak_mb"] if base["peak_mb"] else float("nan")
        if name not in ("nondp", out.get("reference")) and ref is not None:
            res[f"max_rel_err_vs_{out['reference']}"] = max(float((g[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30))
                                             for k in ref)
    return out


def case_label(case: dict) -> str:
    k = case["layer"]
    if k == "linear":
        return f"Linear T={case['T']} d={case['d']} p={case['p']}"
    if k == "conv2d":
        return f"Conv2d {case['cin']}→{case['cout']} k{case['k']} {case['hw']}²"
    if k == "embedding":
        return f"Embedding V={case['vocab']} d={case['d']} T={case['T']}"
    if k in ("lstm", "gru"):
        return f"{k.upper()} T={case['T']} d=H={case['H']} L={case['L']}{' bi' if case['bi'] else ''}"
    if k in TOKEN_KINDS:
        return token_label(case)
    if k == "embedding_bag":
        return f"EmbeddingBag V={case['vocab']} d={case['d']} N={case['N']}"
    name = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm", "hf_rmsnorm": "LlamaRMSNorm", "custom": "GatedScale"}[k]
    return f"{name} d={case['d']} T={case['T']}"


#: how the "engine chose" column names the rule of a layer without paths
_RULE_NAMES = {"InstantiatedGradsRule": "generic rule", "HFRMSNormRule": "rule by class name"}


def render(result: dict) -> str:
    """Markdown: a time table and a memory table (ratios to non-DP from the same run)."""
    cols = [c for c in ["nondp", "engine", "engine_ghost", "engine_inst", "engine_reuse", "engine_generic", "func", "naive", "opacus",
                        "proto_inst_reuse"] if any(c in r["methods"] for r in result["cases"])]
    head = ["layer (B=%d)" % result["batch"], "engine chose", "floor", "non-DP ms"] + [
        f"{c} ×" for c in cols[1:]]
    rows, mrows = [], []
    for r in result["cases"]:
        m = r["methods"]
        chose = r["engine_choice"] or _RULE_NAMES.get((r.get("rules") or {}).get("engine"), "exact")
        rows.append([case_label(r["case"]), chose, r.get("arithmetic_floor"),
                     m["nondp"]["median_ms"]] + [m[c]["time_ratio"] if c in m else None for c in cols[1:]])
        mrows.append([case_label(r["case"]), m["nondp"]["peak_mb"]] +
                     [m[c]["mem_ratio"] if c in m else None for c in cols[1:]])
    mhead = ["layer", "non-DP peak MB"] + [f"{c} ×" for c in cols[1:]]
    return ("**Time** (median thread CPU time, ratio to non-DP forward+backward of the same layer, same run)\n\n"
            + md_table(head, rows)
            + "\n\n**Peak tensor memory** (torch.profiler memory events, ratio to non-DP)\n\n"
            + md_table(mhead, mrows) + "\n")


def _merged(path: str, new: dict) -> dict:
    """The results at ``path`` with ``new``'s cases in place of (or after) theirs, in ``CASES`` order; the run
    that measured each merged case is listed under ``merged_runs``."""
    import json
    from pathlib import Path

    old = json.loads(Path(path).read_text())
    if (old["batch"], old["reps"], old["warmup"], old["threads"]) != (new["batch"], new["reps"], new["warmup"],
                                                                      new["threads"]):
        raise SystemExit("--merge needs the same --batch, --reps, --warmup and --threads as the results it joins")
    labels = {case_label(r["case"]): r for r in old["cases"]}
    labels.update({case_label(r["case"]): r for r in new["cases"]})
    order = [case_label(c) for c in CASES]
    old["cases"] = sorted(labels.values(), key=lambda r: order.index(case_label(r["case"]))
                          if case_label(r["case"]) in order else len(order))
    old.setdefault("merged_runs", []).append({"cases": [case_label(r["case"]) for r in new["cases"]],
                                              "machine_before": new["machine_before"], "wall_s": new["wall_s"]})
    return old


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = least noisy)")
    ap.add_argument("--quick", action="store_true", help="3 reps, 1 warm-up, batch 4 (a smoke test)")
    ap.add_argument("--out", default=None, help="default: results/per_layer_cpu.json (core), per_layer_rnn_cpu.json (rnn)")
    ap.add_argument("--set", choices=["core", "rnn"], default="core",
                    help="core: Linear, Conv2d, Embedding, LayerNorm; rnn: LSTM, GRU, EmbeddingBag (with Opacus)")
    ap.add_argument("--cases", default="", help="comma-separated layer kinds of the set to run (default: all)")
    ap.add_argument("--merge", action="store_true", help="replace or add these cases in the JSON at --out, keeping "
                                                         "the others (each case's ratios are from one run)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = str(RESULTS / ("per_layer_rnn_cpu.json" if args.set == "rnn" else "per_layer_cpu.json"))
    if args.quick:
        args.reps, args.warmup, args.batch = 3, 1, 4
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.thread_time if args.threads == 1 else time.process_time
    t0 = time.time()
    result = {"batch": args.batch, "reps": args.reps, "warmup": args.warmup, "threads": args.threads,
              "C": C, "time_method": ("median thread CPU time (time.thread_time), one torch thread" if args.threads == 1
                              else "median process CPU time (time.process_time)"),
              "memory_method": "torch.profiler memory events: peak live CPU tensor bytes during one call",
              "machine_before": machine_info(), "cases": []}
    only = {k for k in args.cases.split(",") if k}
    for case in [c for c in (RNN_CASES if args.set == "rnn" else CASES) if not only or c["layer"] in only]:
        r = run_case(case, args.batch, args.warmup, args.reps)
        result["cases"].append(r)
        m = r["methods"]
        print(f"{case_label(case):40s} choice={r['engine_choice'] or '-':11s} nondp {m['nondp']['median_ms']:8.2f} ms | "
              + " ".join(f"{k} {v['time_ratio']:.2f}x" for k, v in m.items() if k != "nondp"), flush=True)
    result["wall_s"] = time.time() - t0
    result["machine_after"] = machine_info()
    if args.merge:
        result = _merged(args.out, result)
    write_json(args.out, result)
    print(render(result))
    return result


if __name__ == "__main__":
    main()
