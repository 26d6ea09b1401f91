"""User-level DP (``privacy_unit="user"``): Poisson sampling over users, k rows per sampled user, each user's mean
gradient clipped as one, the ledger and ε in users (``sampling/users.py``, ``per_sample/units.py``)."""

from __future__ import annotations

import math

import dp_accounting
import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

import lightning_dpzero  # noqa: F401  (registers the strategies)
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback
from lightning_dpzero.accounting import PrivacyLedger
from lightning_dpzero.mechanism import DPMechanism
from lightning_dpzero.accounting.plan import PrivacyPlan
from lightning_dpzero.sampling.users import UserPoissonBatchSampler, user_codes
from oracle import clipped_sum, per_example_grads_loop, unit_means

# 10 users of 1 to 3 rows, the rows of a user not adjacent
USERS = ["p0", "p1", "p2", "p0", "p3", "p4", "p2", "p5", "p6", "p0", "p7", "p8", "p9", "p2", "p7", "p3"]


class Notes(Dataset):
    """Rows (features, label, index) with one patient id per row."""

    def __init__(self, users=USERS):
        self.user_ids, self.n = list(users), len(users)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(5, generator=g), i % 3, i


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.append(idx.tolist())
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


# ------------------------------------------------------------------------------------------------ the sampler
def test_a_user_with_more_than_k_rows_contributes_k_distinct_rows_drawn_uniformly():
    users = np.array([0] * 5 + [1] + [2] * 3)
    sampler = UserPoissonBatchSampler(users, sample_rate=1.0, max_examples_per_user=2, steps_per_epoch=400, seed=1)
    counts = np.zeros(len(users))
    for batch in sampler:
        units = sampler.pop_units()
        assert len(batch) == len(units) == 5 and len(set(batch)) == 5  # 2 + 1 + 2, without replacement
        for u in range(3):
            assert len({int(users[i]) for i, v in zip(batch, units) if v == u}) == 1  # a unit is one user
        counts[batch] += 1
    np.testing.assert_allclose(counts[:5], 400 * 2 / 5, rtol=0.2)  # each of user 0's rows: 2/5 of the steps
    assert counts[5] == 400 and np.all(counts[6:] == pytest.approx(400 * 2 / 3, rel=0.2))


def test_users_are_never_split_across_ranks_or_micro_batches():
    users = np.repeat(np.arange(30), 3)
    samplers = [UserPoissonBatchSampler(users, 0.3, 3, num_replicas=2, rank=r, accumulate_grad_batches=2,
                                        steps_per_epoch=20, seed=5) for r in range(2)]
    streams = [list(s) for s in samplers]
    for step in range(20):
        owners = {}
        for r in range(2):
            for m in range(2):
                for u in {int(users[i]) for i in streams[r][2 * step + m]}:
                    assert u not in owners, f"user {u} in two micro-batches of step {step}"
                    owners[u] = (r, m)
                    assert sum(users[streams[r][2 * step + m]] == u) == 3  # all its rows, together


def test_each_user_is_included_at_rate_q():
    users = np.repeat(np.arange(200), 2)
    sampler = UserPoissonBatchSampler(users, sample_rate=0.1, max_examples_per_user=1, steps_per_epoch=50, seed=3)
    included = sum(len(b) for b in sampler)  # one row per included user
    mean, sd = 0.1 * 200 * 50, math.sqrt(200 * 50 * 0.1 * 0.9)
    assert abs(included - mean) < 5 * sd
    assert sampler.num_samples == 200 and sampler.expected_batch_size == pytest.approx(20.0)


def test_user_ids_are_read_through_a_subset_and_refused_when_missing_or_wrong():
    np.testing.assert_array_equal(user_codes(Subset(Notes(), [3, 0, 1])), [0, 0, 1])
    bare = Notes()
    del bare.user_ids
    with pytest.raises(ValueError, match="has no `user_ids`"):
        user_codes(bare)
    short = Notes()
    short.user_ids = ["a", "b", "c"]
    with pytest.raises(ValueError, match="3 ids for 16 rows"):
        user_codes(short)


# ------------------------------------------------------------------------------------------------ the Trainer
def _fit(k, *, sigma=0.0, steps=1, batch_size=4, **strategy):
    L.seed_everything(0, verbose=False)
    model = Module()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=sigma, max_grad_norm=0.1, seed=3,
                                                     clipping="all-layer", privacy_unit="user",
                                                     max_examples_per_user=k, **strategy),
                        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[PrivacyAccountantCallback(delta=1e-5)])
    trainer.fit(model, DataLoader(Notes(), batch_size=batch_size))
    return trainer, model, init


@pytest.mark.parametrize("k", [1, 2, 3])  # below, at and (k=3) at the largest user's 3 rows
def test_one_step_equals_the_clipped_mean_of_each_sampled_users_rows(k):
    trainer, model, init = _fit(k)
    rows = model.seen[0]
    assert rows, "an empty first draw: pick another seed"
    by_user = {}
    for i in rows:
        by_user.setdefault(USERS[i], []).append(i)
    assert all(len(v) <= k for v in by_user.values())
    assert any(USERS.count(u) > k for u in by_user) or k == 3
    ref_model = Module().net
    ref_model.load_state_dict({n.split(".", 1)[1]: v for n, v in init.items()})
    data = Notes()
    x = torch.stack([data[i][0] for i in rows])
    y = torch.tensor([data[i][1] for i in rows])
    per = per_example_grads_loop(ref_model, F.cross_entropy, x, y)
    summed = clipped_sum(ref_model, unit_means(per, [USERS[i] for i in rows]), 0.1, "all-layer")
    q = 4 / 10
    for n, p in model.named_parameters():
        want = init[n].double() - summed[n.split(".", 1)[1]] / (q * 10)  # lr 1, σ = 0: (Σ_u clip(g_u)) / (q·U)
        torch.testing.assert_close(p.detach().double(), want, rtol=0, atol=1e-6, msg=lambda m: f"{n}: {m}")
    ledger = trainer.strategy.ledger
    assert ledger.privacy_unit == {"unit": "user", "max_examples_per_user": k} and ledger.dataset_size == 10
    assert ledger.entries[0].sample_rate == pytest.approx(q)


def test_epsilon_is_per_user_and_equals_dp_accountings_pld_at_q_over_users():
    trainer, _, _ = _fit(2, sigma=1.0, steps=3, batch_size=2)
    q, ledger = 2 / 10, trainer.strategy.ledger
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), 3))
    assert ledger.steps == 3 and ledger.dataset_size == 10
    assert ledger.epsilon() == pytest.approx(pld.get_epsilon(1e-5), rel=2e-3)


def test_bad_user_level_settings_are_refused_before_the_first_update():
    with pytest.raises(ValueError, match="poisson_sampling=False"):
        _fit(2, poisson_sampling=False)
    with pytest.raises(ValueError, match="max_examples_per_user=0 must be at least 1"):
        DPDeepSpeedStrategy(privacy_unit="user", max_examples_per_user=0)
    with pytest.raises(ValueError, match="q = .* > 1"):
        _fit(2, batch_size=11)


# ------------------------------------------------------------------------------------------------ resume
def _plan(unit):
    return PrivacyPlan(dataset_size=10, sample_rate=0.2, expected_batch_size=2.0, noise_multiplier=1.0, delta=1e-5,
                       planned_steps=5, sampler_kind="poisson", privacy_unit=unit)


@pytest.mark.parametrize("saved,now", [({"unit": "user", "max_examples_per_user": 2}, None),
                                       (None, {"unit": "user", "max_examples_per_user": 2}),
                                       ({"unit": "user", "max_examples_per_user": 2},
                                        {"unit": "user", "max_examples_per_user": 3})])
def test_a_checkpoint_resumed_with_another_privacy_unit_is_refused(saved, now):
    ledger = PrivacyLedger(delta=1e-5, dataset_size=10, privacy_unit=saved)
    ledger.charge(0.2, 1.0, steps=4)
    mechanism = DPMechanism(1.0, 1.0, seed=0)
    mechanism.restore_ledger(PrivacyLedger.from_json(ledger.to_json()))
    with pytest.raises(ValueError, match="privacy unit"):
        mechanism.use_plan(_plan(now))


def test_the_user_level_ledger_is_continued_on_resume_and_its_unit_is_hashed():
    unit = {"unit": "user", "max_examples_per_user": 2}
    ledger = PrivacyLedger(delta=1e-5, dataset_size=10, privacy_unit=unit)
    ledger.charge(0.2, 1.0, steps=4)
    mechanism = DPMechanism(1.0, 1.0, seed=0)
    mechanism.restore_ledger(PrivacyLedger.from_json(ledger.to_json()))
    mechanism.use_plan(_plan(unit))
    assert mechanism.ledger.steps == 4 and mechanism.ledger.privacy_unit == unit
    forged = ledger.to_dict()
    forged["privacy_unit"]["max_examples_per_user"] = 1
    with pytest.raises(ValueError, match="hash chain"):
        PrivacyLedger.from_dict(forged)


@pytest.mark.slow
def test_user_level_on_zero3_with_two_processes_matches_the_per_user_replay(tmp_path):
    """ZeRO-3 and ZeRO-0 on 2 processes, Poisson sampling over 12 users of 1 to 3 rows with k below and above the
    largest user, accumulation over 2 micro-batches, σ = 0: each step equals the replay of Σ_u clip(mean of u's
    rows' gradients) / (q·U) over the users the two ranks drew."""
    from harness import expected_params, run_cases

    users = [f"u{(7 * i) % 12}" for i in range(24)]
    users = [u if i % 5 else "u0" for i, u in enumerate(users)]  # some users of 1, some of 3 rows
    cases = [dict(name=f"users_{stage}_{clip}_k{k}", model="token", stage=stage, sigma=0.0, C=0.3, clipping=clip,
                  clipping_fn="abadi", poisson=True, accumulate=2, steps=3, n=24, batch_size=2, lr=0.5,
                  users=users, strategy_kwargs=dict(privacy_unit="user", max_examples_per_user=k))
             for stage, clip, k in ((3, "all-layer", 2), (3, "layer-wise", 4), (0, "all-layer", 1))]
    results = run_cases(cases, tmp_path, world_size=2, timeout=900)
    for case in cases:
        res = results[case["name"]]
        assert res["global_step"] == case["steps"] and res["ledger"]["dataset_size"] == len(set(users))
        for step in {s for rank in res["seen"] for s, _ in rank}:  # a user's rows on one rank, at most k of them
            per_rank = [[users[i] for s, idx in rank if s == step for i in idx] for rank in res["seen"]]
            assert not set(per_rank[0]) & set(per_rank[1]), (case["name"], step)
            k = case["strategy_kwargs"]["max_examples_per_user"]
            assert all(rows.count(u) <= k for rows in per_rank for u in rows), (case["name"], step)
        want = expected_params(case, res)
        for name, v in want.items():
            torch.testing.assert_close(res["final"][name], v.float(), rtol=0, atol=1e-5,
                                       msg=lambda m: f"{case['name']} {name}: {m}")


def test_the_planner_plans_in_users(capsys):
    """``plan --users U --max-examples-per-user k`` plans q = B·W·K/U and records the unit; ε equals N=U's."""
    from lightning_dpzero.planner import plan_main, plan_run

    user = plan_run(1000, 10, max_steps=100, noise_multiplier=1.0, max_examples_per_user=3)
    rows = plan_run(1000, 10, max_steps=100, noise_multiplier=1.0)
    assert user.plan.privacy_unit == {"unit": "user", "max_examples_per_user": 3}
    assert rows.plan.privacy_unit is None
    assert user.plan.sample_rate == rows.plan.sample_rate == 10 / 1000
    assert user.epsilon_pld == rows.epsilon_pld
    assert plan_main(["--users", "1000", "--max-examples-per-user", "3", "--batch-size", "10",
                      "--max-steps", "100", "--noise-multiplier", "1.0"]) == 0
    assert "users U:                1000 (user-level, at most 3 rows per user" in capsys.readouterr().out
    with pytest.raises(ValueError, match="max_examples_per_user must be >= 1"):
        plan_run(1000, 10, max_steps=100, noise_multiplier=1.0, max_examples_per_user=0)


def test_a_fabric_loop_clips_each_sampled_users_mean_gradient():
    """DPFabricStrategy(privacy_unit="user"): the Fabric loop's first step equals the per-user reference (σ = 0)."""
    from lightning.fabric import Fabric

    from lightning_dpzero import DPFabricStrategy

    strategy = DPFabricStrategy(stage=2, noise_multiplier=0.0, max_grad_norm=0.1, seed=3, clipping="all-layer",
                                privacy_unit="user", max_examples_per_user=2)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    init = {n: p.detach().clone() for n, p in net.named_parameters()}
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1.0))
    loader = fabric.setup_dataloaders(DataLoader(Notes(), batch_size=4))
    x, y, idx = next(iter(loader))
    fabric.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    rows = idx.tolist()
    assert len({USERS[i] for i in rows}) < len(rows)  # some user gave two rows: the units matter
    ref = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    ref.load_state_dict(init)
    per = per_example_grads_loop(ref, F.cross_entropy, x.detach(), y)
    summed = clipped_sum(ref, unit_means(per, [USERS[i] for i in rows]), 0.1, "all-layer")
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.detach().double(), init[n].double() - summed[n] / 4, rtol=0, atol=1e-6)
    assert strategy.ledger.privacy_unit == {"unit": "user", "max_examples_per_user": 2}


def _trainer(tmp_path, steps, **strategy):
    return L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0, max_grad_norm=0.1, seed=3,
                                                  **strategy),
                     accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                     callbacks=[PrivacyAccountantCallback(delta=1e-5)])


def test_a_trainer_checkpoint_resumes_the_user_level_ledger_and_refuses_example_level(tmp_path):
    user = dict(privacy_unit="user", max_examples_per_user=2)
    trainer = _trainer(tmp_path, 2, **user)
    trainer.fit(Module(), DataLoader(Notes(), batch_size=4))
    trainer.save_checkpoint(tmp_path / "ckpt")
    eps2 = trainer.strategy.ledger.epsilon()
    resumed = _trainer(tmp_path, 4, **user)
    resumed.fit(Module(), DataLoader(Notes(), batch_size=4), ckpt_path=tmp_path / "ckpt")
    ledger = resumed.strategy.ledger
    assert ledger.steps == 4 and ledger.run_id == trainer.strategy.ledger.run_id and ledger.epsilon() > eps2
    assert ledger.privacy_unit == {"unit": "user", "max_examples_per_user": 2} and ledger.dataset_size == 10
    with pytest.raises(ValueError, match="privacy unit"):
        _trainer(tmp_path, 4).fit(Module(), DataLoader(Notes(), batch_size=4), ckpt_path=tmp_path / "ckpt")
