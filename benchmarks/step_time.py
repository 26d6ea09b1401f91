"""Whole-step time and memory of DP training against non-DP, one process launch per configuration.

Two groups of configurations per model (the GPT-style decoder and the small CNN of ``benchmarks.models``):

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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (RESULTS, machine_info, md_table, median, peak_rss_bytes, reset_peak_rss,
                               rss_bytes, write_json)
from benchmarks.models import (build_model, linear_shapes, loss_fn, make_data, model_floor, param_count,
                               zero_model_states)

SIGMA, CLIP = 1.0, 1.0
ROOT = Path(__file__).resolve().parent.parent


# ===================================================================================== configurations
def model_kwargs(model: str, args) -> dict:
    if model.startswith("gpt"):
        kw = dict(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers, seq=args.seq)
        if model == "gpt-lora":
            kw["lora_rank"] = args.lora_rank
        return kw
    return dict(channels=args.cnn_channels, image=32, classes=10)


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
        return args.cnn_batch if model == "cnn" and args.cnn_batch else args.batch

    acc = f"/acc{args.accumulate}" if args.accumulate > 1 else ""

    def ds(model, stage, method, **kw):
        name = f"{model}/zero{stage}{acc}/{method}"
        base = f"{model}/zero{stage}{acc}/nondp"
        cases.append(dict(common, name=name, group=f"{model}/zero{stage}{acc}", baseline=base, kind="lightning",
                          accumulate=args.accumulate,
                          profile=args.profile,
                          model=model, model_kw=model_kwargs(model, args), stage=stage, method=method,
                          world=W, batch=micro(model), threads=args.threads_per_proc,
                          precision=args.precision, **kw))

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
                if s == args.detail_stage:
                    ds("gpt", s, "group", clipping="group-wise", clipping_fn="abadi",
                       clipping_groups=gpt_groups(args.layers))
                    ds("gpt", s, "layer-auto", clipping="layer-wise", clipping_fn="automatic")
            if args.lora_rank:
                ds("gpt-lora", args.detail_stage, "nondp")
                ds("gpt-lora", args.detail_stage, "layer", clipping="layer-wise", clipping_fn="abadi")
        elif model == "cnn":
            for s in stages:
                ds("cnn", s, "nondp")
                ds("cnn", s, "layer", clipping="layer-wise", clipping_fn="abadi")
                if s == max(stages):
                    ds("cnn", s, "all", clipping="all-layer", clipping_fn="abadi")
        for m in args.single_methods:
            single(model, m)
    if args.only:
        rx = re.compile(args.only)
        keep = {c["name"] for c in cases if rx.search(c["name"])}
        keep |= {c["baseline"] for c in cases if c["name"] in keep}
        cases = [c for c in cases if c["name"] in keep]
    return cases


# ===================================================================================== worker: Lightning
def _cpu_deepspeed_strategy():
    """Lightning's ``DeepSpeedStrategy`` with the CPU overrides ``DPDeepSpeedStrategy`` had when these
    results were measured (strategy.py at 4f5bd91: ``setup_environment``, ``setup_distributed``,
    ``_setup_model_and_optimizer``), and nothing else. On a GPU every method is Lightning's own."""
    from lightning.pytorch.accelerators import CUDAAccelerator  # not lightning_fabric's unrelated class
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from lightning.pytorch.strategies.ddp import DDPStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self):
            if isinstance(self.accelerator, CUDAAccelerator):
                return super().setup_environment()
            DDPStrategy.setup_environment(self)

        def setup_distributed(self):
            if isinstance(self.accelerator, CUDAAccelerator):
                return super().setup_distributed()
            from lightning.fabric.utilities.seed import reset_seed
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
            if isinstance(self.accelerator, CUDAAccelerator):
                return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
            import argparse as _ap

            import deepspeed
            engine, ds_opt, _, _ = deepspeed.initialize(
                args=_ap.Namespace(device_rank=self.local_rank), config=self.config, model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
                lr_scheduler=lr_scheduler, dist_init_required=False)
            return engine, ds_opt

    return CPUDeepSpeedStrategy


def model_state_bytes(engine) -> dict:
    """Bytes this rank holds for parameters, gradients, optimizer states and other ZeRO buffers.

    Walks the module's parameters (``data``, ZeRO-3's ``ds_tensor``, ``grad``), the base optimizer's
    parameters (ZeRO 1–3: the fp32 partition) and states, then the ZeRO optimizer's attributes (tensors in
    lists and dicts, two levels deep): attributes named ``*grad*`` are gradients, the rest "buffers"
    (communication buckets, allocated with ``empty`` and so not necessarily resident). Each storage counts
    once, in the first category that reaches it.
    """
    seen, cats = set(), {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0}

    def add(t, cat):
        if not isinstance(t, torch.Tensor):
            return
        try:
            st = t.untyped_storage()
        except Exception:  # noqa: BLE001 - meta or sparse tensors
            return
        key = (st.data_ptr(), st.nbytes())
        if st.nbytes() == 0 or key in seen:
            return
        seen.add(key)
        cats[cat] += st.nbytes()

    def walk(obj, cat, depth):
        if isinstance(obj, torch.Tensor):
            add(obj, cat)
        elif depth > 0 and isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o, cat, depth - 1)
        elif depth > 0 and isinstance(obj, dict):
            for o in obj.values():
                walk(o, cat, depth - 1)

    for p in engine.module.parameters():
        add(p.data, "params")
        add(getattr(p, "ds_tensor", None), "params")
        add(p.grad, "grads")
    opt = engine.optimizer
    base = opt
    while hasattr(base, "optimizer") and not isinstance(base, torch.optim.Optimizer):
        base = base.optimizer
    if isinstance(base, torch.optim.Optimizer):
        for group in base.param_groups:
            for p in group["params"]:
                add(p, "optimizer")
                add(p.grad, "grads")
        for state in base.state.values():
            walk(state, "optimizer", 2)
    if opt is not base and opt is not None:
        for name, val in vars(opt).items():
            walk(val, "grads" if "grad" in name.lower() else "buffers", 3)
    cats["model_states"] = cats["params"] + cats["grads"] + cats["optimizer"]
    return cats


def lightning_worker(cfg: dict) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_dpzero  # noqa: F401  (registers the strategies)
    from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback

    torch.set_num_threads(cfg["threads"])
    total = cfg["warmup"] + cfg["steps"]
    W, B, K = cfg["world"], cfg["batch"], cfg.get("accumulate", 1)  # a step: K micro-batches (timed together)
    on_gpu = cfg["accelerator"] == "gpu"
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    class Bench(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(cfg["seed"])
            self.net = build_model("gpt" if cfg["model"].startswith("gpt") else "cnn", **cfg["model_kw"])

        def training_step(self, batch, batch_idx):
            x, y = batch
            return loss_fn(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-4)

        def train_dataloader(self):
            n = (total + 2) * B * W * K
            x, y = make_data("gpt" if cfg["model"].startswith("gpt") else "cnn", n, seed=1, **cfg["model_kw"])
            return DataLoader(TensorDataset(x, y), batch_size=B, shuffle=True, drop_last=True)

    prof = None
    if cfg.get("profile") and int(os.environ.get("RANK", "0")) == 0:
        from benchmarks.profile_engine import instrument_strategy

        instrument_strategy()
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU])

    class StepStart(L.Callback):
        """First callback: a step starts here (after data loading)."""

        def __init__(self, t_fit):
            self.t0 = self.c0 = None
            self.t_fit, self.marks = t_fit, {}
            self.rf = None

        def on_train_start(self, trainer, *a):
            self.marks["setup_s"] = time.perf_counter() - self.t_fit  # fit() call → training starts

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx % K:
                return  # inside an accumulation window: the step started at its first micro-batch
            if prof is not None and trainer.global_step == cfg["warmup"]:
                prof.start()
            if prof is not None and trainer.global_step >= cfg["warmup"]:
                self.rf = torch.profiler.record_function("step")
                self.rf.__enter__()
            if on_gpu:
                torch.cuda.synchronize()
            self.t0, self.c0 = time.perf_counter(), time.process_time()

    class StepTimer(L.Callback):
        """Last callback: the step ends after every other callback's on_train_batch_end (the privacy
        accountant's ε update included)."""

        def __init__(self, start):
            self.start, self.times, self.cpu, self.states = start, [], [], None

        def on_before_optimizer_step(self, trainer, *a):
            if trainer.global_step == total - 1:  # after the last backward, before its update
                self.states = model_state_bytes(trainer.strategy.deepspeed_engine)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % K:
                return
            if on_gpu:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start.t0)
            self.cpu.append(time.process_time() - self.start.c0)
            if self.start.rf is not None:
                self.start.rf.__exit__(None, None, None)
                self.start.rf = None

    module = Bench()
    start = StepStart(time.perf_counter())
    timer = StepTimer(start)
    callbacks = [start]
    if cfg["method"] == "nondp":
        strategy = _cpu_deepspeed_strategy()(stage=cfg["stage"])
    else:
        strategy = DPDeepSpeedStrategy(stage=cfg["stage"], noise_multiplier=SIGMA, max_grad_norm=CLIP,
                                       clipping=cfg["clipping"], clipping_fn=cfg["clipping_fn"],
                                       clipping_groups=cfg.get("clipping_groups"), poisson_sampling=False,
                                       seed=1234)
        callbacks.append(PrivacyAccountantCallback(delta=1e-5))
    callbacks.append(timer)
    trainer = L.Trainer(strategy=strategy, accelerator=cfg["accelerator"], devices=W, max_steps=total,
                        precision=cfg["precision"], callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=True, accumulate_grad_batches=K)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    base = rss_bytes()
    reset_peak_rss()
    start.t_fit = time.perf_counter()
    trainer.fit(module)
    out = {"rank": trainer.global_rank, "step_s": timer.times, "cpu_s": timer.cpu, "rss_base": base,
           "rss_peak": peak_rss_bytes(), "model_states": timer.states, **start.marks}
    if prof is not None:
        from benchmarks.profile_engine import summarize

        prof.stop()
        out["profile"] = summarize(prof, cfg["steps"])
    if on_gpu:
        out["cuda_peak"] = torch.cuda.max_memory_allocated()
    return out


# ===================================================================================== worker: one process
def single_worker(cfg: dict) -> dict:
    """One process, plain loop: ``cfg['method']`` in nondp, ours-layer, ours-all, opacus-hooks,
    opacus-ghost, naive, func."""
    from torch import nn
    from torch.func import functional_call, grad, vmap

    torch.set_num_threads(cfg["threads"])
    dev = torch.device("cuda" if cfg["accelerator"] == "gpu" else "cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    kind = "gpt" if cfg["model"].startswith("gpt") else "cnn"
    torch.manual_seed(cfg["seed"])
    model = build_model(kind, **cfg["model_kw"]).to(dev)
    B, total, method = cfg["batch"], cfg["warmup"] + cfg["steps"], cfg["method"]
    x_all, y_all = make_data(kind, B * total, seed=1, **cfg["model_kw"])
    batches = [(x_all[i * B:(i + 1) * B].to(dev), y_all[i * B:(i + 1) * B].to(dev)) for i in range(total)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-4)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def add_noise_and_scale():
        for p in params:
            p.grad.add_(torch.randn_like(p), alpha=SIGMA * CLIP).div_(B)

    if method == "nondp":
        def step(x, y):
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif method in ("ours-layer", "ours-all"):
        from lightning_dpzero.per_sample import PerSampleEngine

        eng = PerSampleEngine(model, CLIP, "layer-wise" if method == "ours-layer" else "all-layer").attach()

        def step(x, y):
            with eng.micro_batch(batch_size=x.shape[0]):
                loss_fn(model(x), y).backward()
            add_noise_and_scale()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif method.startswith("opacus"):
        import warnings

        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        warnings.filterwarnings("ignore")
        loader = DataLoader(TensorDataset(x_all, y_all), batch_size=B)
        pe = PrivacyEngine(accountant="prv")
        if method == "opacus-hooks":
            model, opt, _ = pe.make_private(module=model, optimizer=opt, data_loader=loader,
                                            noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False,
                                            grad_sample_mode="hooks")

            def step(x, y):
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            model, opt, crit, _ = pe.make_private(module=model, optimizer=opt, data_loader=loader,
                                                  criterion=nn.CrossEntropyLoss(), noise_multiplier=SIGMA,
                                                  max_grad_norm=CLIP, poisson_sampling=False,
                                                  grad_sample_mode="ghost")

            def step(x, y):
                out = model(x)
                if out.dim() == 3:
                    loss = crit(out.reshape(-1, out.shape[-1]), y.reshape(-1), shape=out.shape)
                else:
                    loss = crit(out, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    elif method == "naive":
        def step(x, y):
            total_g = [torch.zeros_like(p) for p in params]
            for i in range(x.shape[0]):
                gs = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params)
                norm = torch.sqrt(sum(g.pow(2).sum() for g in gs))
                c = (CLIP / norm.clamp_min(1e-12)).clamp(max=1.0)
                for t, g in zip(total_g, gs):
                    t.add_(g * c)
            for p, t in zip(params, total_g):
                p.grad = t
            add_noise_and_scale()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif method == "func":
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        frozen.update(dict(model.named_buffers()))

        def loss_one(prm, x1, y1):
            out = functional_call(model, {**frozen, **prm}, (x1.unsqueeze(0),))
            return loss_fn(out, y1.unsqueeze(0))

        per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))

        def step(x, y):
            prm = {n: p.detach() for n, p in zip(names, params)}
            gs = per_example(prm, x, y)
            norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in gs.values()))
            coef = (CLIP / norms.clamp_min(1e-12)).clamp(max=1.0)
            for n, p in zip(names, params):
                p.grad = torch.einsum("b,b...->...", coef, gs[n])
            del gs
            add_noise_and_scale()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        raise ValueError(f"unknown method {method!r}")

    model.train()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = rss_bytes()
    reset_peak_rss()
    times, cpu = [], []
    for x, y in batches:
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        step(x, y)
        sync()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    out = {"rank": 0, "step_s": times, "cpu_s": cpu, "rss_base": base, "rss_peak": peak_rss_bytes(), "model_states": None}
    if dev.type == "cuda":
        out["cuda_peak"] = torch.cuda.max_memory_allocated()
    return out


# ===================================================================================== launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _warn_stale_build_locks() -> None:
    """Killing a DeepSpeed CPU worker while it holds torch's extension-build lock leaves the lock file
    behind, and every later DeepSpeed CPU launch on the machine (anyone's) then waits on it forever.
    Say so; removing it is left to a person who can see that no build is running."""
    for lock in Path.home().glob(".cache/torch_extensions/*/*/lock"):
        print(f"WARNING: {lock} exists after killing a worker; if no compiler is running, remove it, or "
              "every DeepSpeed CPU launch on this machine waits on it.", flush=True)


def launch(cfg: dict, logdir: Path, timeout: float) -> dict:
    """Run one configuration in fresh processes (``cfg['world']`` ranks for Lightning, else one);
    returns the merged result, or ``{"error": ...}`` with the log's tail."""
    tag = cfg["name"].replace("/", "_")
    cfg_path = logdir / f"{tag}.json"
    cfg_path.write_text(json.dumps(cfg))
    n = cfg["world"] if cfg["kind"] == "lightning" else 1
    procs, logs = [], []
    for attempt in range(2):
        port = _free_port()
        procs, logs = [], []
        for rank in range(n):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n),
                       RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(n),
                       OMP_NUM_THREADS=str(cfg["threads"]), PYTHONWARNINGS="ignore",
                       PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            log = logdir / f"{tag}.rank{rank}.log"
            logs.append(log)
            res = logdir / f"{tag}.rank{rank}.result.json"
            if res.exists():
                res.unlink()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.step_time", "--worker", str(cfg_path), "--result", str(res)],
                cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT))
        t0 = time.time()
        codes, first_fail = [None] * n, None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if first_fail is None and any(c not in (None, 0) for c in codes):
                first_fail = time.time()  # e.g. rank 0 lost the port race: the others would wait for it
            if (first_fail is not None and time.time() - first_fail > 30) or time.time() - t0 > timeout:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                _warn_stale_build_locks()
                codes = [p.returncode if c is None or c == 0 else c for p, c in zip(procs, codes)]
                codes = [c if c is not None else "killed" for c in codes]
                if time.time() - t0 > timeout:
                    codes.append("timeout")
                break
            time.sleep(0.5)
        text = "\n".join(log.read_text(errors="replace")[-4000:] for log in logs)
        if any(codes) and "address already in use" in text.lower() and attempt == 0:
            continue  # lost the race for the rendezvous port: once more
        break
    wall = time.time() - t0
    if any(codes):
        return {"error": f"exit codes {codes}", "log_tail": text[-3000:], "launch_wall_s": wall}
    ranks = [json.loads((logdir / f"{tag}.rank{r}.result.json").read_text()) for r in range(n)]
    steps = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    timed = steps[cfg["warmup"]:]
    cpu = [sum(r["cpu_s"][i] for r in ranks) for i in range(len(ranks[0]["cpu_s"]))][cfg["warmup"]:]
    out = {"median_s": median(timed), "step_s": timed, "warmup_s": steps[:cfg["warmup"]],
           "cpu_median_s": median(cpu), "cpu_s": cpu,
           "rss_peak_mb": [r["rss_peak"] / 2**20 for r in ranks],
           "rss_base_mb": [r["rss_base"] / 2**20 for r in ranks],
           "rss_growth_mb": [(r["rss_peak"] - r["rss_base"]) / 2**20 for r in ranks],
           "model_states": ranks[0].get("model_states"), "launch_wall_s": wall,
           "worker_s": max(r.get("worker_s", 0.0) for r in ranks),
           "setup_s": max(r.get("setup_s", 0.0) for r in ranks)}
    if ranks[0].get("profile"):
        out["profile_rank0"] = ranks[0]["profile"]
    if "cuda_peak" in ranks[0]:
        out["cuda_peak_mb"] = [r["cuda_peak"] / 2**20 for r in ranks]
    return out


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
        if "cuda_peak_mb" in r and "cuda_peak_mb" in b:
            r["cuda_peak_ratio"] = max(r["cuda_peak_mb"]) / max(b["cuda_peak_mb"])


def render(res: dict) -> str:
    """Markdown tables: step time, ratio, floor and memory per configuration; ZeRO model states."""
    facts = res["facts"]
    rows = []
    for r in res["results"]:
        f = facts[r["model"]]
        if "error" in r:
            rows.append([r["name"], "failed: " + r["error"]] + [None] * 9)
            continue
        gpu = "cuda_peak_mb" in r
        rows.append([r["name"], 1e3 * r["median_s"], r.get("time_ratio"), 1e3 * r["cpu_median_s"],
                     r.get("cpu_ratio"), f["floor"] if r["method"] != "nondp" else None,
                     max(r["cuda_peak_mb"]) if gpu else max(r["rss_peak_mb"]),
                     r.get("cuda_peak_ratio") if gpu else r.get("rss_peak_ratio"),
                     None if gpu else max(r["rss_growth_mb"]), None if gpu else r.get("rss_growth_ratio"),
                     len(r["step_s"])])
    mem = "CUDA peak" if any("cuda_peak_mb" in r for r in res["results"]) else "peak RSS"
    out = [md_table(["configuration", "wall ms", "× non-DP", "CPU ms (Σ procs)", "× non-DP", "floor",
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
    ap.add_argument("--models", default="gpt,cnn", type=lambda s: s.split(","))
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
    ap.add_argument("--accumulate", type=int, default=1,
                    help="accumulate_grad_batches of the DeepSpeed runs (> 1: configurations named .../accK/...)")
    ap.add_argument("--precision", default="32-true", help="Lightning precision of the DeepSpeed runs")
    ap.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
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
        out = lightning_worker(cfg) if cfg["kind"] == "lightning" else single_worker(cfg)
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
           "sigma": SIGMA, "C": CLIP, "machine_before": machine_info(), "facts": facts, "results": []}
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
    res["wall_s"] = time.time() - t_start
    res["machine_after"] = machine_info()
    write_json(args.out, res)
    print(render(res), flush=True)
    return res


if __name__ == "__main__":
    main()
