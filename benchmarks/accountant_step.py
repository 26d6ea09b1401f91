"""What ``PrivacyAccountantCallback.on_train_batch_end`` costs the training loop, per optimizer step.

One CPU process, a tiny model (Linear 16-32-2), ``DPDeepSpeedStrategy(stage=0)``, σ calibrated to a target ε (so
the budget guard runs too), ``--steps`` optimizer steps; the hook is timed with ``time.perf_counter`` around every
call. ``--step-ms`` adds that much matrix work to each ``training_step`` (torch releases the GIL there), standing
in for a real model's step, during which the callback's worker thread can compute ahead.

Usage::

    python -m benchmarks.accountant_step [--steps 200] [--step-ms 0] [--worker process|thread|none] [--out FILE]

``--worker none`` computes inside the step, as the callback did before it had a worker. Run it against another
checkout of the package (without the option) with ``PYTHONPATH=that/checkout``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dpzero  # noqa: F401
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback


class Tiny(L.LightningModule):
    def __init__(self, step_ms: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        self.step_ms = step_ms
        self.work = torch.randn(256, 256)

    def training_step(self, batch, _):
        if self.step_ms:  # stand-in for a real model's compute: matrix products until step_ms have passed
            end = time.perf_counter() + self.step_ms / 1000
            while time.perf_counter() < end:
                self.work = torch.tanh(self.work @ self.work)
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Timed(PrivacyAccountantCallback):
    """The callback with its per-step hook timed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.times: list[float] = []
        self.waited = None

    def on_train_batch_end(self, *args, **kwargs):
        t = time.perf_counter()
        super().on_train_batch_end(*args, **kwargs)
        self.times.append(time.perf_counter() - t)

    def _close_accounting(self):  # keep the worker's count of answers the step had to wait for
        if getattr(self, "_ahead", None) is not None:
            self.waited = self._ahead.waited
        super()._close_accounting()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--worker", default=None, choices=["process", "thread", "none"],
                    help="PrivacyAccountantCallback(accounting_worker=...); default: the callback's default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.manual_seed(0)
    n, b = 3200, 32  # q = 0.01
    data = TensorDataset(torch.randn(n, 16), torch.randint(0, 2, (n,)))
    kw = {} if args.worker is None else {"accounting_worker": args.worker}
    callback = Timed(target_epsilon=8.0, delta=1e-5, **kw)
    trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=0, seed=0, logging_level=logging.ERROR),
                        accelerator="cpu", devices=1, max_steps=args.steps, callbacks=[callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    start = time.perf_counter()
    trainer.fit(Tiny(args.step_ms), DataLoader(data, batch_size=b, shuffle=True))
    wall = time.perf_counter() - start
    ms = sorted(t * 1000 for t in callback.times)
    result = {"steps": len(ms), "step_ms": args.step_ms, "worker": getattr(callback, "accounting_worker", "(none)"),
              "hook_mean_ms": statistics.fmean(ms), "hook_median_ms": statistics.median(ms),
              "hook_p99_ms": ms[int(0.99 * (len(ms) - 1))], "hook_max_ms": ms[-1], "hook_total_ms": sum(ms),
              "first_50_mean_ms": statistics.fmean(t * 1000 for t in callback.times[:50]),
              "fit_wall_s": wall, "epsilon": callback.epsilon(),
              "waited": getattr(callback, "waited", None)}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
