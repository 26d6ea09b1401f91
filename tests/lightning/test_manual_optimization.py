"""Manual optimization (``automatic_optimization = False``) on the Trainer's DP strategy (``lightning/manual_loop.py``):
each ``manual_backward`` + ``opt.step()`` of a ``training_step`` is one DP step on that batch, equal to the
single-process replay from per-example gradients (I2) on ZeRO-3 with 1 and 2 processes, noised as automatic
optimization's (I3) and charged once (I4); every pattern the ledger would not account exactly is refused before
its update."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dp_worker
from harness import check_noise_std, expected_params, run_cases
from lightning_dpzero import DPDeepSpeedStrategy
from lightning_dpzero.mechanism import NonFiniteLossError

BASE = dict(model="token", n=48, batch_size=4, lr=0.5, steps=3, sigma=0.0, C=0.3, clipping="layer-wise",
            clipping_fn="abadi", poisson=True, accumulate=1, stage=3, manual=True)


def _check_replay(case, res):
    assert res["global_step"] == case["steps"] == res["deepspeed_global_steps"], case["name"]
    assert sum(e["steps"] for e in res["ledger"]["entries"]) == case["steps"], case["name"]
    want = expected_params(case, res)
    assert max(float((res["final"][k] - res["init"][k]).abs().max()) for k in want) > 1e-4, case["name"]
    for k, v in want.items():
        torch.testing.assert_close(res["final"][k], v.float(), rtol=0, atol=1e-5, msg=lambda m: f"{case['name']} {k}: {m}")


def _in_process(case, tmp_path):
    """``dp_worker.run_case`` in this process (one rank), its records read back as ``harness.run_cases`` does."""
    dp_worker.run_case(case, str(tmp_path), 1)
    res = torch.load(tmp_path / f"{case['name']}.pt", weights_only=False)
    res["seen"] = [json.loads((tmp_path / f"{case['name']}.seen0.json").read_text())]
    return res


@pytest.mark.parametrize("case", [
    dict(BASE, name="manual_lw_s3"),
    dict(BASE, name="manual_al_s3_closure", clipping="all-layer", closure=True),
    # one expected example per step: some batches are empty and run on their one-row stand-in (a noise-only step)
    dict(BASE, name="manual_al_s2_empty", clipping="all-layer", stage=2, batch_size=1, steps=8, seed=3),
], ids=lambda c: c["name"])
def test_a_manual_optimization_module_matches_the_replay_in_one_process(case, tmp_path):
    res = _in_process(case, tmp_path)
    if case["batch_size"] == 1:
        sizes = [len(idx) for _, idx in res["seen"][0]]
        assert 0 in sizes and max(sizes) > 0, sizes
    _check_replay(case, res)


@pytest.mark.slow
def test_manual_optimization_on_zero3_with_two_processes_matches_the_replay_and_is_noised(tmp_path):
    # all-layer: deferred writes at the end of a backward that runs inside DeepSpeed's forward (a rank whose batch is
    # empty writes nothing: no collective may hide in the writes); layer-wise with opt.step(closure) and empty batches
    cases = [dict(BASE, name="manual_al_s3", clipping="all-layer"),
             dict(BASE, name="manual_lw_s3_closure", closure=True, batch_size=1, steps=4),
             dict(BASE, name="manual_2pass_s3", clipping="all-layer", clipping_mode="two-pass"),
             dict(BASE, name="manual_noise_s0", model="wide", stage=0, sigma=1.5, C=2.0, lr=1.0, steps=1,
                  zero_loss=True, n=256)]
    results = run_cases(cases, tmp_path, world_size=2, timeout=900)
    for case in cases[:-1]:
        _check_replay(case, results[case["name"]])
    check_noise_std(cases[-1], results[cases[-1]["name"]], 2)


# ------------------------------------------------------------------------------------------ refused, before the update
class Manual(L.LightningModule):
    """A manual-optimization module whose ``pattern`` of calls the strategy must refuse (or, ``"once"``, take)."""

    def __init__(self, pattern="once", loss_scale=1.0):
        super().__init__()
        self.automatic_optimization = False
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.pattern, self.loss_scale, self.calls, self.scheduler_steps = pattern, loss_scale, 0, 0

    def _loss(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y) * self.loss_scale

    def training_step(self, batch, batch_idx):
        self.calls += 1
        opt, p = self.optimizers(), self.pattern
        opt.zero_grad()
        if p == "skip_odd" and batch_idx % 2:  # a batch the module leaves out: nothing released, nothing charged
            return None
        if p == "twice_backward":
            self.manual_backward(self._loss(batch))
            self.manual_backward(self._loss(batch))
        elif p != "no_backward":
            self.manual_backward(self._loss(batch))
        if p != "no_step":
            opt.step()
        if p == "two_steps":
            self.manual_backward(self._loss(batch))
            opt.step()
        if p == "step_again":
            opt.step()
        self.lr_schedulers().step()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: self._count_scheduler_step())
        return [opt], [sch]

    def _count_scheduler_step(self):
        self.scheduler_steps += 1
        return 1.0

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)),
                          batch_size=4)


def _fit(model, steps=2, **strategy_kwargs):
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0, seed=0, **strategy_kwargs)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        trainer.fit(model)
    finally:
        model.moved = any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    return trainer, strategy


@pytest.mark.parametrize("pattern,match", [
    ("twice_backward", "manual_backward called twice before opt.step"),
    ("no_backward", r"opt.step\(\) without self.manual_backward"),
    ("two_steps", "manual_backward after opt.step"),
    ("step_again", r"opt.step\(\) called twice in one training_step"),
    ("no_step", r"manual_backward without opt.step\(\) in the same training_step"),
])
def test_what_the_ledger_would_not_account_is_refused_before_its_update(pattern, match):
    model = Manual(pattern)
    with pytest.raises(RuntimeError, match=match):
        _fit(model)
    # refused at the first batch: nothing applied (the second step of "two_steps" and "step_again" neither: the first
    # step on the batch was applied, charged, and is the only one)
    assert model.moved == (pattern in ("two_steps", "step_again"))


def test_one_step_per_batch_is_charged_once_and_the_layout_check_advances_nothing():
    """The per-example check re-runs training_step five times at the first batch and four at each later one
    (layout_check="every-batch"): its backward, step and scheduler step are inert, so Lightning's global_step, DeepSpeed's steps, the ledger and the scheduler count each step once."""
    model = Manual("once")
    trainer, strategy = _fit(model, steps=3)
    assert trainer.global_step == strategy.ledger.steps == strategy.deepspeed_engine.global_steps == 3
    assert model.calls == 3 + 5 + 2 * 4  # the check's re-runs: five at the first batch, four at each later one
    assert model.scheduler_steps == 1 + 3  # its first call at construction, then once per step
    assert model.moved


def test_a_batch_left_out_is_neither_released_nor_charged():
    model = Manual("skip_odd")
    trainer, strategy = _fit(model, steps=2)
    assert trainer.global_step == strategy.ledger.steps == 2
    assert model.calls == 3 + 5 + 4 + 4  # steps on batches 0 and 2, batch 1 left out; the check's re-runs


def test_a_non_finite_loss_in_manual_backward_stops_before_the_update_with_the_step_charged():
    model = Manual("once", loss_scale=math.inf)
    with pytest.raises(NonFiniteLossError):
        _fit(model)
    assert not model.moved


class TwoOptimizers(Manual):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.body[0].parameters(), lr=0.1), torch.optim.SGD(self.body[2].parameters(), lr=0.1)]


def test_several_optimizers_are_refused_with_what_dp_can_do_instead():
    with pytest.raises(MisconfigurationException, match=r"single optimizer.*post_processing\(generator\).*dp-gan"):
        _fit(TwoOptimizers())
