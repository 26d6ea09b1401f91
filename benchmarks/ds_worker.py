"""The Lightning + DeepSpeed worker of the step-time benchmarks: one rank of one configuration.

``benchmarks.launch`` starts ``world`` of these (``python -m benchmarks.step_time --worker CFG``) with the
``torchrun`` environment; each runs ``cfg['warmup'] + cfg['steps']`` optimizer steps of the configuration
and returns its step times (wall and CPU), peak RSS and, on the last step, the bytes of model states the
engine holds (:func:`model_state_bytes`). ``cfg['strategy_kw']`` (optional) goes to both strategies (e.g.
``offload_optimizer``), ``cfg['ds_config']`` (optional) is merged into their DeepSpeed configuration.
"""

from __future__ import annotations

import os
import time

import torch

from benchmarks.common import CLIP, SIGMA, peak_rss_bytes, profiled_peak_bytes, reset_peak_rss, rss_bytes
from benchmarks.models import build_model, loss_fn, make_data


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


def make_trainer(cfg: dict, first: list, last: list):
    """The configuration's LightningModule and Trainer: Lightning's own ``DeepSpeedStrategy`` (with the CPU
    overrides) for ``nondp``, else ``DPDeepSpeedStrategy`` with the privacy accountant; callbacks ``first``
    before the accountant, ``last`` after it. Returns ``(trainer, module)``."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_dpzero  # noqa: F401  (registers the strategies)
    from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback

    total = cfg["warmup"] + cfg["steps"] + cfg.get("extra_steps", 0)
    W, B, K = cfg["world"], cfg["batch"], cfg.get("accumulate", 1)
    kind = "gpt" if cfg["model"].startswith("gpt") else "cnn"

    class Bench(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(cfg["seed"])
            self.net = build_model(kind, **cfg["model_kw"])

        def training_step(self, batch, batch_idx):
            x, y = batch
            return loss_fn(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-4)

        def train_dataloader(self):
            x, y = make_data(kind, (total + 2) * B * W * K, seed=1, **cfg["model_kw"])
            return DataLoader(TensorDataset(x, y), batch_size=B, shuffle=True, drop_last=True)

    callbacks = list(first)
    if cfg["method"] == "nondp":
        strategy = _cpu_deepspeed_strategy()(stage=cfg["stage"], **cfg.get("strategy_kw", {}))
    else:
        strategy = DPDeepSpeedStrategy(stage=cfg["stage"], noise_multiplier=SIGMA, max_grad_norm=CLIP,
                                       clipping=cfg["clipping"], clipping_fn=cfg["clipping_fn"],
                                       clipping_groups=cfg.get("clipping_groups"), poisson_sampling=False,
                                       clipping_mode=cfg.get("clipping_mode", "book-keeping"),
                                       seed=1234, **cfg.get("strategy_kw", {}))
        callbacks.append(PrivacyAccountantCallback(delta=1e-5))
    strategy.config.update(cfg.get("ds_config", {}))  # e.g. zero_force_ds_cpu_optimizer for offload + Adam
    trainer = L.Trainer(strategy=strategy, accelerator=cfg["accelerator"], devices=W, max_steps=total,
                        precision=cfg["precision"], callbacks=callbacks + list(last), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=True, accumulate_grad_batches=K)
    return trainer, Bench()


def takes_memory_step(cfg: dict) -> bool:
    """Whether a run takes one more step after the timed ones, under the profiler's memory record: the peak of
    the allocator's live bytes during a step, above those live when it starts (deterministic, unlike RSS). On
    the CPU only, and every rank takes it or none does (``--profile`` profiles rank 0 only: no memory step on
    any rank). ``cfg['memory_step'] = False`` (the largest-model search, the scaling grid): none, as the
    profiler's records and the extra step would count in the peak RSS those report."""
    return cfg["accelerator"] != "gpu" and not cfg.get("profile") and cfg.get("memory_step", True)


def lightning_worker(cfg: dict) -> dict:
    import lightning as L

    torch.set_num_threads(cfg["threads"])
    total = cfg["warmup"] + cfg["steps"]
    K = cfg.get("accumulate", 1)  # a step: K micro-batches (timed together)
    on_gpu = cfg["accelerator"] == "gpu"
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    prof = None
    if cfg.get("profile") and int(os.environ.get("RANK", "0")) == 0:
        from benchmarks.profile_engine import instrument_strategy

        instrument_strategy()
        from torch.profiler import ProfilerActivity, profile

        # on a GPU its kernels too: how the step's host time compares with the GPU's busy time
        prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else []))

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
            if trainer.global_step == total and memory is not None:  # the extra step after the timed ones
                memory.start()
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
            self.start, self.times, self.cpu, self.states, self.alloc_peak = start, [], [], None, None

        def on_before_optimizer_step(self, trainer, *a):
            if trainer.global_step == total - 1:  # after the last backward, before its update
                self.states = model_state_bytes(trainer.strategy.deepspeed_engine)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % K:
                return
            if trainer.global_step > total:  # the memory-profiled step: not timed
                memory.stop()
                self.alloc_peak = profiled_peak_bytes(memory)
                return
            if on_gpu:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start.t0)
            self.cpu.append(time.process_time() - self.start.c0)
            if self.start.rf is not None:
                self.start.rf.__exit__(None, None, None)
                self.start.rf = None

    memory = None
    if takes_memory_step(cfg):
        from torch.profiler import ProfilerActivity, profile

        memory = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    start = StepStart(time.perf_counter())
    timer = StepTimer(start)
    trainer, module = make_trainer(dict(cfg, extra_steps=int(memory is not None)), [start], [timer])
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    base = rss_bytes()
    reset_peak_rss()
    start.t_fit = time.perf_counter()
    trainer.fit(module)
    out = {"rank": trainer.global_rank, "step_s": timer.times, "cpu_s": timer.cpu, "rss_base": base,
           "rss_peak": peak_rss_bytes(), "model_states": timer.states, **start.marks}
    if timer.alloc_peak is not None:
        out["alloc_peak"] = timer.alloc_peak
    if prof is not None:
        from benchmarks.profile_engine import summarize

        prof.stop()
        out["profile"] = summarize(prof, cfg["steps"])
    if on_gpu:
        out["cuda_peak"] = torch.cuda.max_memory_allocated()
    return out

