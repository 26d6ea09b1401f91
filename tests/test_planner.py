"""`lightning-dpzero plan` and :func:`lightning_dpzero.planner.plan_run`: the σ, q and steps a run will fix.

The planner must print the σ that calibration during training reproduces: each test of that fits for real
(1 CPU process, DeepSpeed, gloo) and compares the strategy's plan with the planner's, exactly. The formulas
the planner shares with the DP samplers are checked against the samplers over many sizes."""

import json
import re

import lightning as L
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dpzero  # noqa: F401
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback
from lightning_dpzero.cli import main
from lightning_dpzero.planner import _micro_batches_per_epoch, _sample_rate, plan_run, settings_from_config
from lightning_dpzero.sampling import (DistributedPoissonBatchSampler, DistributedShuffledBatchSampler,
                                       poisson_sample_rate)

N = 48


class Net(L.LightningModule):
    def __init__(self, batch_size):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.batch_size = batch_size

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(N, 4, generator=g), torch.randint(0, 2, (N,), generator=g))
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)


def _fit(batch_size, strategy_kw, accountant_kw, **trainer_kw):
    strategy = DPDeepSpeedStrategy(stage=2, **strategy_kw)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[PrivacyAccountantCallback(**accountant_kw)], **trainer_kw)
    trainer.fit(Net(batch_size))
    return strategy.plan


@pytest.mark.parametrize("case", [
    dict(batch_size=4, strategy_kw={}, accountant_kw={"target_epsilon": 4.0}, trainer_kw={"max_epochs": 2}),
    dict(batch_size=3, strategy_kw={}, accountant_kw={"target_epsilon": 2.0, "delta": 1e-6, "accountant": "rdp"},
         trainer_kw={"max_epochs": 3, "accumulate_grad_batches": 2, "limit_train_batches": 0.5}),
    dict(batch_size=4, strategy_kw={"poisson_sampling": False}, accountant_kw={"target_epsilon": 3.0},
         trainer_kw={"max_steps": 7, "accumulate_grad_batches": 3}),
], ids=["epochs", "accumulate-limit-rdp", "shuffle-max-steps"])
def test_the_planned_sigma_is_the_one_training_calibrates(case):
    fitted = _fit(case["batch_size"], case["strategy_kw"], case["accountant_kw"], **case["trainer_kw"])
    tk = case["trainer_kw"]
    planned = plan_run(N, case["batch_size"], accumulate_grad_batches=tk.get("accumulate_grad_batches", 1),
                       max_epochs=tk.get("max_epochs"), max_steps=tk.get("max_steps"),
                       limit_train_batches=tk.get("limit_train_batches", 1.0),
                       poisson_sampling=case["strategy_kw"].get("poisson_sampling", True),
                       **case["accountant_kw"]).plan
    assert planned == fitted  # σ bit for bit, q, N, δ, B_exp, planned steps, sampler, accountant, target


def test_a_given_sigma_is_planned_as_trained_and_its_epsilon_reported():
    fitted = _fit(4, {"noise_multiplier": 1.3}, {"target_epsilon": 8.0}, max_epochs=2)
    run = plan_run(N, 4, max_epochs=2, noise_multiplier=1.3, target_epsilon=8.0)
    assert run.plan == fitted and not run.calibrated
    from lightning_dpzero.accounting import epsilon_for

    assert run.epsilon_pld == epsilon_for(1.3, 1e-5, 4 / N, fitted.planned_steps, "pld")
    assert run.epsilon_rdp == epsilon_for(1.3, 1e-5, 4 / N, fitted.planned_steps, "rdp")
    assert run.steps_within_budget > fitted.planned_steps


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), b=st.integers(1, 64), w=st.integers(1, 8), k=st.integers(1, 4))
def test_the_planners_formulas_are_the_samplers(n, b, w, k):
    """q and the micro-batches of an epoch as the DP samplers have them (a changed sampler fails here)."""
    try:
        q = poisson_sample_rate(b, w, k, n)
    except ValueError:
        with pytest.raises(ValueError, match="exceeds the dataset"):
            _sample_rate(b, w, k, n)
        return
    assert _sample_rate(b, w, k, n) == q
    poisson = DistributedPoissonBatchSampler(n, q, w, 0, k)
    assert _micro_batches_per_epoch(n, q, b, w, k, True) == len(poisson)
    try:
        shuffled = DistributedShuffledBatchSampler(n, b, w, 0, k)
    except ValueError:
        with pytest.raises(ValueError, match="examples per rank"):
            _micro_batches_per_epoch(n, q, b, w, k, False)
        return
    assert shuffled.sample_rate == q and _micro_batches_per_epoch(n, q, b, w, k, False) == len(shuffled)


def test_plan_command_prints_sigma_q_steps_and_both_epsilons(capsys, tmp_path):
    args = ["plan", "--dataset-size", "60000", "--batch-size", "64", "--devices", "2", "--accumulate", "2",
            "--epochs", "3", "--target-epsilon", "8", "--delta", "1e-5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    run = plan_run(60000, 64, devices=2, accumulate_grad_batches=2, max_epochs=3, target_epsilon=8.0)
    sigma = float(re.search(r"noise multiplier sigma: (\S+)", out).group(1))
    assert sigma == run.plan.noise_multiplier and "calibrated" in out
    assert float(re.search(r"sample rate q:\s+(\S+)", out).group(1)) == 256 / 60000
    assert re.search(r"planned steps:\s+702\b", out)  # 3 epochs x round(60000 / 256) = 234 steps
    assert float(re.search(r"epsilon \(pld\):\s+(\S+)", out).group(1)) == run.epsilon_pld <= 8.0
    assert float(re.search(r"epsilon \(rdp\):\s+(\S+)", out).group(1)) == run.epsilon_rdp
    assert main(args + ["--json", "--plot", str(tmp_path / "eps.png")]) == 0
    printed = json.loads(capsys.readouterr().out.split("\n}")[0] + "\n}")
    assert printed["noise_multiplier"] == sigma and printed["planned_steps"] == 702 and printed["calibrated"]
    assert (tmp_path / "eps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_refuses_what_the_run_would(capsys):
    # an explicit σ over the budget: the message of the run's own refusal, with the steps that fit
    assert main(["plan", "--dataset-size", "1000", "--batch-size", "10", "--max-steps", "5000",
                 "--noise-multiplier", "0.8", "--target-epsilon", "1"]) == 1
    fits = re.search(r"only (\d+) steps fit in the budget.*train at most \1 steps \(Trainer\(max_steps=\1\)\)",
                     capsys.readouterr().err)
    assert fits and 0 < int(fits[1]) < 5000
    # not even one step fits: no "only 0 steps ... at most that many", but what one step costs and what to change
    assert main(["plan", "--dataset-size", "1000", "--batch-size", "100", "--max-steps", "500",
                 "--noise-multiplier", "0.8", "--target-epsilon", "1"]) == 1
    err = capsys.readouterr().err
    assert "only 0 steps" not in err and "at most" not in err
    assert re.search(r"no step fits at this σ: a single step already costs ε=2\.\d+\. .*calibrate it.*raise "
                     r"target_epsilon.*lower the sample rate q", err), err
    assert main(["plan", "--dataset-size", "100", "--batch-size", "64", "--devices", "2", "--epochs", "1",
                 "--target-epsilon", "8"]) == 1
    assert "exceeds the dataset" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--batch-size", "64", "--epochs", "1", "--target-epsilon", "8"])
    assert exc.value.code == 2 and "--dataset-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--dataset-size", "100", "--batch-size", "4", "--epochs", "1", "--trainer.max_steps=3"])
    assert "need --config" in capsys.readouterr().err


def test_plan_from_a_config_reads_what_fit_reads():
    """The digits config: N from the model's loader, B, 2 devices and 20 epochs from the trainer, the target
    from its PrivacyAccountantCallback; numbers and overrides given beside it win."""
    s = settings_from_config(["--config", "examples/configs/digits.yaml"])
    assert s["dataset_size"] == 1500 and s["batch_size"] == 128 and s["devices"] == 2 and s["max_epochs"] == 20
    assert s["target_epsilon"] == 8.0 and s["delta"] == 1e-5 and s["noise_multiplier"] is None
    assert settings_from_config(["--config", "examples/configs/digits.yaml", "--trainer.max_epochs=2"])["max_epochs"] == 2
    run = plan_run(**s)
    assert run.plan.sample_rate == 256 / 1500 and run.plan.planned_steps == 20 * 6
