"""A CPU-measurable proxy of GPU cost: the aten operators dispatched per optimizer step, and the host syncs.

On a GPU a step of small layers is bound by the host: every operator the step dispatches is a kernel launch
(or more), and every device-to-host read stalls the queue. Counting them on the CPU measures that cost without
a GPU. One process runs the public Trainer path (``benchmarks.ds_worker.make_trainer``: Lightning's
``DeepSpeedStrategy`` for non-DP, ``DPDeepSpeedStrategy`` layer-wise and all-layer, the same model, data and
Adam, ZeRO-2, fp32 on the CPU) and counts, inside one optimizer step after ``--warmup`` steps (the first step's
layout check is not in it), with a ``TorchDispatchMode``:

* **all dispatched**: every aten (and c10d) operator call that reaches the dispatcher below autograd: the
  forward, the backward (autograd's own ops and the engine's), DeepSpeed's reduction and Adam, the noise, the
  accountant's update;
* **compute**: those less the ones that launch no kernel: views and other aliases (``OpOverload.is_view``,
  ``detach``, ``alias``, ``lift_fresh``), empty allocations (``empty*``), and the host reads below;
* **host syncs**: ``aten::_local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``, ``int(t)``, a
  Python ``if t``) and the Python-level ``Tensor.tolist`` / ``Tensor.numpy`` calls (which read the data without
  dispatching an operator); each is a device-to-host read that would wait for the GPU.

Prints per method the counts per step, their ratios to non-DP, the compute ops per clipping site (a site: one
call of a layer the engine attached) beyond non-DP's, the step time (median of the counted run's steps, not
comparable across machines), and the per-operator difference of each DP method over non-DP; writes
``benchmarks/results/op_count.json``.

Usage::

    python -m benchmarks.op_count [--d-model 128] [--seq 64] [--layers 4] [--batch 8] [--warmup 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import RESULTS, machine_info, md_table, median, write_json

#: operators that launch no kernel: aliases and allocations without a fill
NON_COMPUTE = {"detach", "alias", "lift_fresh", "empty", "empty_strided", "empty_like", "new_empty",
               "new_empty_strided", "_local_scalar_dense", "set_", "resize_", "_unsafe_view"}
SYNC_OPS = {"_local_scalar_dense"}


def op_name(func) -> str:
    """``aten.mul.Tensor`` → ``mul``; a c10d op keeps its namespace (``c10d.allreduce_``)."""
    ns, name = func.namespace, func._schema.name.split("::")[-1]
    return name if ns == "aten" else f"{ns}.{name}"


def is_compute(func) -> bool:
    return not (getattr(func, "is_view", False) or op_name(func) in NON_COMPUTE)


class OpCounter(TorchDispatchMode):
    """Counts every operator dispatched while active, by name (``all``), and those :func:`is_compute`
    (``compute``); ``syncs`` counts host reads (``_local_scalar_dense`` and the Python-level ``tolist`` /
    ``numpy`` calls, patched while active)."""

    def __init__(self):
        super().__init__()
        self.all, self.compute, self.syncs = Counter(), Counter(), Counter()
        self._patched: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        self.all[name] += 1
        if is_compute(func):
            self.compute[name] += 1
        if name in SYNC_OPS:
            self.syncs[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for meth in ("tolist", "numpy"):
            original = getattr(torch.Tensor, meth)

            def counted(t, *a, _orig=original, _name=meth, **k):
                self.syncs[_name] += 1
                return _orig(t, *a, **k)

            self._patched.append((meth, original))
            setattr(torch.Tensor, meth, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for meth, original in self._patched:
            setattr(torch.Tensor, meth, original)
        self._patched = []
        return super().__exit__(*exc)


def count_run(method: str, model_kw: dict, batch: int, warmup: int, steps: int, stage: int = 2) -> dict:
    """One ``trainer.fit`` of ``method`` (``nondp``, ``layer-wise``, ``all-layer``): the operators of step
    ``warmup`` (0-based), the median time of the steps after it, and the number of clipping sites per step."""
    import lightning as L

    from benchmarks.ds_worker import make_trainer

    counter = OpCounter()
    times: list[float] = []
    sites: list[int] = []

    class Count(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.t0 = time.perf_counter()
            if trainer.global_step == warmup:
                engine = getattr(trainer.strategy, "per_sample", None)
                if engine is not None:  # a site is one clipped call: count the engine's registrations
                    original = engine._register_site

                    def register(hook, _orig=original):
                        sites.append(1)
                        return _orig(hook)

                    engine._register_site = register
                counter.__enter__()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == warmup + 1:
                counter.__exit__(None, None, None)
                engine = getattr(trainer.strategy, "per_sample", None)
                if engine is not None:
                    del engine._register_site
            elif trainer.global_step > warmup + 1:
                times.append(time.perf_counter() - self.t0)

    cfg = dict(method="nondp" if method == "nondp" else "ours", clipping=method, clipping_fn="abadi",
               world=1, batch=batch, warmup=warmup, steps=steps + 1, model="gpt", model_kw=model_kw, seed=0,
               stage=stage, precision="32-true", accelerator="cpu")
    trainer, module = make_trainer(cfg, [], [Count()])
    trainer.fit(module)
    return {"method": method, "all": sum(counter.all.values()), "compute": sum(counter.compute.values()),
            "syncs": sum(counter.syncs.values()), "sync_kinds": dict(counter.syncs), "sites": len(sites),
            "by_op": dict(counter.all), "compute_by_op": dict(counter.compute),
            "step_s": median(times) if times else float("nan")}


def one_process_env() -> None:
    """The ``torchrun`` variables of a one-process run (Lightning would otherwise relaunch)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
                     NODE_RANK="0", LOCAL_WORLD_SIZE="1").items():
        os.environ.setdefault(k, v)


def measure(methods=("nondp", "layer-wise", "all-layer"), d_model: int = 128, seq: int = 64, layers: int = 4,
            batch: int = 8, warmup: int = 2, steps: int = 3, heads: int = 4) -> dict:
    """Counts of each method (``count_run``) and their ratios to non-DP. Returns ``{"config", "runs"}``."""
    import logging
    import warnings

    one_process_env()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    model_kw = dict(d_model=d_model, seq=seq, layers=layers, heads=heads, vocab=256)
    runs = {m: count_run(m, model_kw, batch, warmup, steps) for m in methods}
    base = runs.get("nondp")
    if base is not None:
        for r in runs.values():
            r["ratio_all"] = r["all"] / base["all"]
            r["ratio_compute"] = r["compute"] / base["compute"]
            r["extra_syncs"] = r["syncs"] - base["syncs"]
            r["compute_per_site"] = (r["compute"] - base["compute"]) / r["sites"] if r["sites"] else 0.0
    config = dict(model_kw, batch=batch, warmup=warmup, stage=2, precision="32-true", world=1,
                  layout_check="default (first step only, not counted)")
    return {"config": config, "runs": runs}


def delta_table(runs: dict, top: int = 14) -> str:
    """Per operator: non-DP's compute count and each DP method's difference over it (largest first)."""
    base = Counter(runs["nondp"]["compute_by_op"])
    dp = [m for m in runs if m != "nondp"]
    names = set(base)
    for m in dp:
        names |= set(runs[m]["compute_by_op"])
    deltas = {n: [runs[m]["compute_by_op"].get(n, 0) - base[n] for m in dp] for n in names}
    order = sorted(names, key=lambda n: -max(abs(d) for d in deltas[n]))[:top]
    rows = [[n, base[n], *[f"{d:+d}" for d in deltas[n]]] for n in order]
    return md_table(["op (compute)", "non-DP", *[f"Δ {m}" for m in dp]], rows)


def summary_table(runs: dict) -> str:
    rows = []
    for m, r in runs.items():
        rows.append([m, r["all"], f"{r.get('ratio_all', 1):.2f}×", r["compute"], f"{r.get('ratio_compute', 1):.2f}×",
                     r["syncs"], r["sites"], f"{r.get('compute_per_site', 0):.1f}", f"{r['step_s'] * 1e3:.1f}"])
    return md_table(["method", "all ops", "ratio", "compute ops", "ratio", "host syncs", "sites",
                     "extra compute ops / site", "step ms (CPU)"], rows)


def main(argv: Optional[list] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    res = measure(d_model=a.d_model, seq=a.seq, layers=a.layers, batch=a.batch, warmup=a.warmup, steps=a.steps)
    res["machine"] = machine_info()
    print(summary_table(res["runs"]))
    print()
    print(delta_table(res["runs"]))
    if not a.no_write:
        write_json(RESULTS / "op_count.json", res)


if __name__ == "__main__":
    main()
