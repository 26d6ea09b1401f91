"""The one-process worker of the step-time benchmarks: a plain PyTorch loop, no DeepSpeed.

Methods: ``nondp``; ``ours-layer`` / ``ours-all`` (``PerSampleEngine`` then noise and the division by B, as
DeepSpeed's pre-step hook does); Opacus 1.6 ``opacus-hooks`` / ``opacus-ghost`` (flat clipping); ``naive``
(a backward per example); ``func`` (``torch.func`` ``vmap(grad)``). Same model, data and Adam for all.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import CLIP, SIGMA, peak_rss_bytes, reset_peak_rss, rss_bytes
from benchmarks.models import build_model, loss_fn, make_data


def build_step(cfg: dict) -> tuple:
    """``cfg['method']``'s model, optimizer and step function on fresh copies of the model and data; returns
    ``(step, batches, sync)``: ``step(x, y)`` runs one optimizer step, ``batches`` the ``warmup + steps``
    batches, ``sync()`` waits for the device."""
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
    return step, batches, sync


def single_worker(cfg: dict) -> dict:
    """One process, plain loop: ``cfg['method']`` in nondp, ours-layer, ours-all, opacus-hooks,
    opacus-ghost, naive, func."""
    step, batches, sync = build_step(cfg)
    dev = torch.device("cuda" if cfg["accelerator"] == "gpu" else "cpu")
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

