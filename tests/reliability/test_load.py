"""Load (issue #5, docs/reliability.md §4): a long run keeps constant memory and constant per-step accounting cost.

10,000 optimizer steps of a tiny model (1 process, ZeRO stage 0, the accountant callback logging every step): about
35 s on 2 idle CPU cores (2.5 ms of CPU per step), longer on a loaded machine. ``DPZERO_LOAD_STEPS`` runs fewer
steps; the memory check then extrapolates the late trend to 10,000.

* RSS (after ``malloc_trim``) grows by less than 16 MB after warm-up (the first 10% of the steps) and, over the
  last half, by less than 8 KB per step; extrapolated to 10,000 steps at that late slope it stays under 80 MB.
  (The accountant's PLD arrays grow with the step count for the first few thousand steps, then level off.)
* CPU time per step in the last 10% of the steps is within a generous factor of the first 10% after warm-up: the
  median step within 2.5x, the mean accounting cost alone (ledger charge + ε tracking) within 2x.

CPU time (``time.thread_time``) rather than wall time, so that other processes on the machine skew it less.
"""

import ctypes
import os
import time

import lightning as L
import numpy as np
import psutil
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dpzero  # noqa: F401
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback, PrivacyLedger
from lightning_dpzero.accounting import EpsilonTracker

pytestmark = pytest.mark.slow

STEPS = int(os.environ.get("DPZERO_LOAD_STEPS", 10_000))
WARMUP = STEPS // 10
EXTRAPOLATE_TO = 10_000


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 2)

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(4096, 4, generator=g), torch.randint(0, 2, (4096,), generator=g)),
                          batch_size=8)


def _trim():
    """Hand freed heap back to the OS first (glibc), so RSS measures live memory, not allocator slack."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Probe(L.Callback):
    """CPU time at the end of every optimizer step and RSS every 50 steps."""

    def __init__(self):
        self.cpu, self.rss, self.proc = [], [], psutil.Process()

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step % 50 == 0:
            _trim()
            self.rss.append((trainer.global_step, self.proc.memory_info().rss))
        self.cpu.append(time.thread_time())


def _timed(owner, name, buckets, step):
    """``owner.name`` wrapped to add the CPU time of every call to the bucket of the current step."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            i = step()
            buckets[i] = buckets.get(i, 0.0) + time.thread_time() - start

    return wrapper


def _windows(per_step, stat=np.mean):
    """(first 10% after warm-up, last 10%) of a per-step series."""
    return float(stat(per_step[WARMUP:WARMUP + STEPS // 10])), float(stat(per_step[-(STEPS // 10):]))


def test_long_run_has_constant_memory_and_per_step_cost(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    probe, accounting = Probe(), {}
    trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=0, noise_multiplier=1.0, seed=0), accelerator="cpu",
                        devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[PrivacyAccountantCallback(delta=1e-5), probe])
    step = lambda: trainer.global_step  # noqa: E731
    monkeypatch.setattr(PrivacyLedger, "charge", _timed(PrivacyLedger, "charge", accounting, step))
    monkeypatch.setattr(EpsilonTracker, "epsilon", _timed(EpsilonTracker, "epsilon", accounting, step))
    try:
        trainer.fit(Tiny())
    finally:
        torch.set_num_threads(threads)
    assert trainer.global_step == STEPS and trainer.strategy.ledger.steps == STEPS
    assert len(trainer.strategy.ledger.entries) == 1  # identical steps merge: the ledger does not grow

    # memory: RSS growth after warm-up, and the growth projected to 10,000 steps at the slope of the last half
    # (the accountant's PLD arrays grow with the step count for the first few thousand steps, then level off)
    steps, rss = np.array(probe.rss, dtype=float).T
    keep, late = steps >= WARMUP, steps >= STEPS // 2
    growth_mb = (rss[keep][-1] - rss[keep][0]) / 2**20
    slope_mb = max(np.polyfit(steps[late], rss[late], 1)[0], 0.0) / 2**20
    projected_mb = growth_mb + slope_mb * max(EXTRAPOLATE_TO - STEPS, 0)
    assert growth_mb < 16, f"RSS grew {growth_mb:.1f} MB over {STEPS - WARMUP} steps"
    assert slope_mb * 1000 < 8, f"RSS still grows {slope_mb * 1000:.2f} MB per 1000 steps (> 8 KB per step)"
    assert projected_mb < 80, f"RSS trend {slope_mb * 1000:.3f} MB per 1000 steps: +{projected_mb:.0f} MB at 10k"

    # time: per step, total and accounting only; last 10% vs first 10% after warm-up
    # (medians for the whole step, robust to other processes' bursts; means for the accounting, whose cost comes
    # in spikes at the tracker's grid points)
    per_step = np.diff(np.array(probe.cpu))
    first, last = _windows(per_step, np.median)
    assert last < 2.5 * first, f"step CPU time {first * 1e3:.2f} ms -> {last * 1e3:.2f} ms"
    acc = np.array([accounting.get(i, 0.0) for i in range(1, STEPS + 1)])
    a_first, a_last = _windows(acc)
    assert a_last < 2.0 * a_first + 1e-4, f"accounting CPU per step {a_first * 1e3:.3f} -> {a_last * 1e3:.3f} ms"
    print(f"\nload: {STEPS} steps, step CPU {first * 1e3:.2f} -> {last * 1e3:.2f} ms, accounting "
          f"{a_first * 1e3:.3f} -> {a_last * 1e3:.3f} ms/step, RSS +{growth_mb:.1f} MB after warm-up "
          f"(trend {slope_mb * 1000:.3f} MB/1000 steps, {projected_mb:.1f} MB projected at {EXTRAPOLATE_TO})")
