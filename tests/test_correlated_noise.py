"""Correlated noise through the Trainer (``noise_mechanism="banded-mf"``): the released noise's covariance over
steps, b = 1 as DP-SGD, the ε of the equivalent rounds, cyclic parts, resume mid-band, and the refusals
(``mechanism.correlated.CorrelatedNoise``, ``sampling/cyclic.py``, ``accounting/banded.py``)."""

from __future__ import annotations

import dp_accounting
import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_dpzero  # noqa: F401  (registers the strategies)
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback
from lightning_dpzero.accounting import compute_epsilon
from lightning_dpzero.accounting.ledger import LedgerEntry
from lightning_dpzero.banded_mf import banded_coefficients, expected_noise_covariance
from lightning_dpzero.noise import NoiseSource
from lightning_dpzero.sampling.cyclic import cyclic_parts

N, BATCH = 24, 4  # q = 1/6, 6 steps per epoch, B_exp = 4


class Rows(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.randn(6, generator=torch.Generator().manual_seed(i)), i % 3, i


class Module(L.LightningModule):
    """``zero_loss``: a loss with zero gradient, so each update is the noise alone (SGD, lr 1)."""

    def __init__(self, zero_loss=False, width=40):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(6, width)
        self.zero_loss, self.seen, self.params = zero_loss, [], []

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(batch[2].tolist())  # once per batch (the layout check re-runs training_step)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        out = self.net(x)
        if self.zero_loss:
            return (out * 0).sum(dim=1).mean()
        return nn.functional.cross_entropy(out[:, :3], y)

    def on_train_start(self):
        self.params.append(self._flat())

    def on_train_batch_end(self, *args):
        self.params.append(self._flat())

    def _flat(self):
        return torch.cat([p.detach().flatten().double().clone() for p in self.parameters()])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def _trainer(steps, root=None, sigma=1.0, target_epsilon=None, **strategy):
    strategy = {"noise_mechanism": "banded-mf", **strategy}
    return L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=sigma, max_grad_norm=1.0, **strategy),
                     accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1 if steps == -1 else None,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=root, callbacks=[PrivacyAccountantCallback(target_epsilon, delta=1e-5)])


def _released_noise(model, std):
    """Each step's released noise in units of its standard deviation: (θ_{t-1} − θ_t) / std, shape (T, coords)."""
    p = torch.stack(model.params)
    return ((p[:-1] - p[1:]) / std).numpy()


def test_the_released_noise_has_covariance_c_inverse_c_inverse_transposed_over_steps():
    steps, bands, samples = 6, 3, []
    for seed in range(3):
        model = Module(zero_loss=True, width=400)
        _trainer(steps, bands=bands, seed=seed).fit(model, DataLoader(Rows(), batch_size=BATCH))
        samples.append(_released_noise(model, std=1.0 / 4))  # σ C / B_exp
    nu = np.concatenate(samples, axis=1)  # (steps, 3 · 2,800 coordinates)
    empirical = nu @ nu.T / nu.shape[1]
    expected = expected_noise_covariance(steps, bands, 1.0)
    np.testing.assert_allclose(empirical, expected, atol=0.06)
    assert abs(expected[1, 0]) > 0.3 and abs(empirical[1, 0]) > 0.25  # correlated: not DP-SGD's identity


def test_one_band_is_dp_sgd_exactly_the_same_draws():
    runs = []
    for strategy in ({"noise_mechanism": "dp-sgd"}, {"bands": 1}):
        model = Module()
        _trainer(3, seed=4, **strategy).fit(model, DataLoader(Rows(), batch_size=BATCH))
        runs.append(torch.stack(model.params))
    assert not torch.equal(runs[0][0], runs[0][-1])
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


def test_epsilon_is_that_of_the_equivalent_rounds_at_the_part_rate():
    trainer = _trainer(5, bands=3, seed=1)
    trainer.fit(Module(), DataLoader(Rows(), batch_size=BATCH))
    ledger = trainer.strategy.ledger
    q = BATCH / N
    assert ledger.steps == 5 and ledger.entries[0].sampler == "cyclic-poisson:3"
    assert ledger.noise_mechanism["bands"] == 3 and ledger.noise_mechanism["partition_seed"] == 1
    # ⌈5 / 3⌉ = 2 Poisson-subsampled Gaussian rounds at q_b = 3q
    rounds = compute_epsilon([LedgerEntry(3 * q, 1.0, 2)], 1e-5)
    assert ledger.epsilon() == pytest.approx(rounds, rel=1e-12)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(3 * q, dp_accounting.GaussianDpEvent(1.0)), 2)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(event).get_epsilon(1e-5)
    assert ledger.epsilon() == pytest.approx(pld, rel=0.02)
    assert ledger.epsilon() > compute_epsilon([LedgerEntry(q, 1.0, 5)], 1e-5)  # weaker amplification per step


def test_the_planner_and_calibration_use_the_same_rounds():
    from lightning_dpzero.planner import plan_run

    trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, max_grad_norm=1.0, seed=1, noise_mechanism="banded-mf",
                                                     bands=3),
                        accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[PrivacyAccountantCallback(target_epsilon=4.0, delta=1e-5)])
    trainer.fit(Module(), DataLoader(Rows(), batch_size=BATCH))
    plan, ledger = trainer.strategy.plan, trainer.strategy.ledger
    assert 4.0 * 0.99 <= ledger.epsilon() <= 4.0  # σ calibrated to the 2 rounds of 6 steps at b = 3
    planned = plan_run(N, BATCH, max_steps=6, target_epsilon=4.0, bands=3)
    assert planned.plan.noise_multiplier == plan.noise_multiplier
    assert planned.epsilon_pld == pytest.approx(ledger.epsilon(), rel=1e-9)
    dp_sgd = plan_run(N, BATCH, max_steps=6, target_epsilon=4.0)
    assert dp_sgd.plan.noise_multiplier < plan.noise_multiplier  # weaker amplification: more noise per step


def test_the_budget_stop_counts_rounds():
    trainer = _trainer(-1, bands=3, seed=1, sigma=2.0, target_epsilon=6.0)  # unbounded: the budget stops it
    trainer.fit(Module(), DataLoader(Rows(), batch_size=BATCH))
    ledger = trainer.strategy.ledger
    assert 3 < ledger.steps and ledger.epsilon() <= 6.0
    bigger = compute_epsilon([LedgerEntry(BATCH / N, 2.0, ledger.steps + 3, "cyclic-poisson:3")], 1e-5)
    assert bigger > 6.0  # the next round would have spent more than the budget


def test_each_step_samples_only_its_part_and_the_parts_cover_the_data_once():
    model = Module()
    trainer = _trainer(12, bands=3, seed=2)  # two epochs
    trainer.fit(model, DataLoader(Rows(), batch_size=BATCH))
    parts = cyclic_parts(N, 3, trainer.strategy.ledger.noise_mechanism["partition_seed"])
    assert sorted(np.concatenate(parts).tolist()) == list(range(N))
    assert len(model.seen) == 12 and sum(map(len, model.seen)) > 0
    for t, rows in enumerate(model.seen):
        assert set(rows) <= set(parts[t % 3].tolist()), t


def test_a_resume_mid_band_continues_the_noise_history_with_fresh_draws(tmp_path, monkeypatch):
    bands, std = 3, 1.0 / 4
    whole = Module(zero_loss=True)
    _trainer(4, seed=5, bands=bands).fit(whole, DataLoader(Rows(), batch_size=BATCH))
    nu = _released_noise(whole, std)
    first = Module(zero_loss=True)
    trainer = _trainer(2, seed=5, bands=bands)
    trainer.fit(first, DataLoader(Rows(), batch_size=BATCH))
    trainer.save_checkpoint(tmp_path / "ckpt")
    np.testing.assert_allclose(_released_noise(first, std), nu[:2], rtol=0, atol=1e-12)

    draws = []  # the fresh z of the resumed run, as its noise source draws them
    normal = NoiseSource.normal
    monkeypatch.setattr(NoiseSource, "normal", lambda self, *a: draws.append(normal(self, *a)) or draws[-1])
    resumed = Module(zero_loss=True)
    _trainer(4, root=tmp_path, seed=5, bands=bands).fit(resumed, DataLoader(Rows(), batch_size=BATCH),
                                                          ckpt_path=tmp_path / "ckpt")
    after = _released_noise(resumed, std)  # steps 3 and 4
    per_step = len(draws) // 2  # one draw per tensor of the optimizer's partition (ZeRO-2: one flat tensor)
    z = np.stack([torch.cat([d.flatten() for d in draws[i * per_step:(i + 1) * per_step]]).double().numpy()
                  for i in (0, 1)])
    c = banded_coefficients(bands)
    history = [nu[1], nu[0]]
    for t in range(2):
        expected = (z[t] - sum(cj * h for cj, h in zip(c[1:], history))) / c[0]
        np.testing.assert_allclose(after[t], expected, rtol=0, atol=1e-4)
        history = [after[t], history[0]]
    assert not np.allclose(after[0], nu[2])  # fresh draws after a resume (a rollback never repeats noise)


@pytest.mark.parametrize("now, match", [({"bands": 2}, "bands=3"), ({"noise_mechanism": "dp-sgd"}, "dp-sgd")])
def test_a_resume_with_another_mechanism_or_bands_is_refused(tmp_path, now, match):
    trainer = _trainer(2, seed=5, bands=3)
    trainer.fit(Module(), DataLoader(Rows(), batch_size=BATCH))
    trainer.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=match):
        _trainer(4, root=tmp_path, seed=5, **now).fit(Module(), DataLoader(Rows(), batch_size=BATCH),
                                                        ckpt_path=tmp_path / "ckpt")


@pytest.mark.parametrize("settings, match", [
    ({"noise_mechanism": "banded-mf"}, "needs bands=b"),
    ({"noise_mechanism": "dp-sgd", "bands": 4}, "DP-SGD has no bands"),
    ({"noise_mechanism": "banded-mf", "bands": 4, "poisson_sampling": False}, "poisson_sampling=False"),
    ({"noise_mechanism": "banded-mf", "bands": 4, "max_micro_batch_size": 8}, "max_micro_batch_size"),
    ({"noise_mechanism": "banded-mf", "bands": 4, "privacy_unit": "user", "max_examples_per_user": 1},
     "privacy_unit='user'"),
    ({"noise_mechanism": "banded-mf", "bands": 0}, "bands=0"),
    ({"noise_mechanism": "blt", "bands": 1}, "bands=b >= 2"),
])
def test_settings_the_analysis_does_not_cover_are_refused_when_constructed(settings, match):
    with pytest.raises(ValueError, match=match):
        DPDeepSpeedStrategy(**settings)


def test_more_bands_than_steps_per_epoch_is_refused_before_the_first_update():
    model = Module()
    with pytest.raises(ValueError, match="q_b = bands · q = 7"):
        _trainer(2, bands=7, seed=0).fit(model, DataLoader(Rows(), batch_size=BATCH))
    assert model.seen == []


@pytest.mark.slow
def test_banded_mf_on_zero3_with_two_processes(tmp_path):
    """ZeRO-3 on 2 processes: σ = 0 with accumulation equals the replay of Σ clip(g_i) / B_exp over the batches
    the ranks drew, each from its step's part; σ = 1 with zero gradients releases noise whose covariance over
    steps is C⁻¹C⁻ᵀ, each rank noising its own partition (as ZeRO-0 on one process does the whole), for banded
    MF and for a BLT."""
    from harness import expected_params, run_cases

    base = dict(stage=3, C=0.3, clipping="all-layer", clipping_fn="abadi", poisson=True, n=48, batch_size=2, lr=0.5)
    cases = [dict(base, name="banded_replay", model="token", sigma=0.0, accumulate=2, steps=5,
                  strategy_kwargs=dict(noise_mechanism="banded-mf", bands=3)),
             dict(base, name="banded_noise", model="wide", sigma=1.0, accumulate=1, steps=6, zero_loss=True,
                  lr=1.0, record_steps=True, strategy_kwargs=dict(noise_mechanism="banded-mf", bands=3)),
             dict(base, name="blt_noise", model="wide", sigma=1.0, accumulate=1, steps=6, zero_loss=True,
                  lr=1.0, record_steps=True, strategy_kwargs=dict(noise_mechanism="blt", bands=3))]
    results = run_cases(cases, tmp_path, world_size=2, timeout=900)

    replay = results["banded_replay"]
    ledger = replay["ledger"]
    assert replay["global_step"] == 5 and ledger["entries"][0]["sampler"] == "cyclic-poisson:3"
    parts = cyclic_parts(48, 3, ledger["noise_mechanism"]["partition_seed"])
    drawn = [(s, i) for rank in replay["seen"] for s, idx in rank for i in idx]
    assert drawn and all(i in set(parts[s % 3].tolist()) for s, i in drawn)
    for name, v in expected_params(cases[0], replay).items():
        torch.testing.assert_close(replay["final"][name], v.float(), rtol=0, atol=1e-5)

    noise = results["banded_noise"]
    std = 1.0 * 0.3 / noise["plan"]["expected_batch_size"]
    flat = torch.stack([torch.cat([p[n].flatten() for n in sorted(p)]).double() for p in noise["steps"]])
    nu = ((flat[:-1] - flat[1:]) / std).numpy()  # (6 steps, 33,024 coordinates: both ranks' partitions)
    np.testing.assert_allclose(nu @ nu.T / nu.shape[1], expected_noise_covariance(6, 3, 1.0), atol=0.05)

    from lightning_dpzero.accounting.blt import blt_of  # BLT: each rank runs the recursion on its own partition

    blt = results["blt_noise"]
    params = blt_of(blt["ledger"]["entries"][0]["sampler"])[1]
    flat = torch.stack([torch.cat([p[n].flatten() for n in sorted(p)]).double() for p in blt["steps"]])
    nu = ((flat[:-1] - flat[1:]) / std).numpy()
    inv = np.linalg.inv(params.matrix(6))
    np.testing.assert_allclose(nu @ nu.T / nu.shape[1], inv @ inv.T, atol=0.05)


def test_a_fabric_loop_samples_its_parts_and_releases_the_banded_noise(tmp_path):
    """DPFabricStrategy(noise_mechanism="banded-mf"): each step's batch comes from its part, the zero-gradient
    updates follow the recursion of the noise, and a checkpoint holds the rank's noise history."""
    from lightning.fabric import Fabric

    from lightning_dpzero import DPFabricStrategy

    strategy = DPFabricStrategy(stage=2, noise_multiplier=1.0, max_grad_norm=1.0, seed=6, max_steps=4,
                                noise_mechanism="banded-mf", bands=3)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Linear(6, 300)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1.0))
    loader = fabric.setup_dataloaders(DataLoader(Rows(), batch_size=BATCH))
    params, seen = [torch.cat([p.detach().flatten().double() for p in net.parameters()])], []
    for step, (x, y, idx) in zip(range(4), loader):
        seen.append(idx.tolist())
        fabric.backward((model(x) * 0).sum(dim=1).mean())
        optimizer.step()
        optimizer.zero_grad()
        params.append(torch.cat([p.detach().flatten().double() for p in net.parameters()]))
    ledger = strategy.ledger
    assert ledger.steps == 4 and ledger.entries[0].sampler == "cyclic-poisson:3"
    parts = cyclic_parts(N, 3, ledger.noise_mechanism["partition_seed"])
    assert all(set(rows) <= set(parts[t % 3].tolist()) for t, rows in enumerate(seen))
    nu = ((torch.stack(params[:-1]) - torch.stack(params[1:])) / 0.25).numpy()
    c = banded_coefficients(3)
    z = [c[0] * nu[t] + sum(c[j] * nu[t - j] for j in (1, 2) if t - j >= 0) for t in range(4)]
    assert all(abs(np.var(zt) - 1) < 0.1 for zt in z)  # the recursion undone: i.i.d. standard normal draws
    assert abs(np.var(nu[2]) - 1) > 0.2  # while the released noise itself is not
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    assert (tmp_path / "ckpt" / "privacy_noise_rank0.pt").is_file()


def test_a_fabric_resume_keeps_the_ledgers_parts_when_the_loader_was_built_first(tmp_path):
    """Without a seed the parts come from OS entropy; a Fabric loop builds its loader before ``fabric.load``, and
    the loaded ledger's partition then replaces the new one."""
    def loop(steps, load=None):
        return fabric_loop(steps, load, noise_mechanism="banded-mf", bands=3)

    fabric, strategy, model, optimizer, _ = loop(2)
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    partition = strategy.ledger.noise_mechanism["partition_seed"]
    _, resumed, _, _, seen = loop(5, load=tmp_path / "ckpt")
    assert resumed.ledger.steps == 5 and resumed.ledger.noise_mechanism["partition_seed"] == partition
    assert resumed.mechanism.correlated.partition_seed == partition
    parts = cyclic_parts(N, 3, partition)
    assert [t for t, _ in seen] == [2, 3, 4]
    assert all(set(rows) <= set(parts[t % 3].tolist()) for t, rows in seen)


def fabric_loop(steps, load=None, **strategy_kwargs):
    """A Fabric loop over ``Rows`` with ``DPFabricStrategy(max_steps=steps, **strategy_kwargs)`` that loads the
    checkpoint ``load`` (after building its loader, as a Fabric script does) and trains to ``steps``; returns
    ``(fabric, strategy, model, optimizer, seen)``, ``seen`` the (ledger step, example indices) of each batch."""
    from lightning.fabric import Fabric

    from lightning_dpzero import DPFabricStrategy

    strategy = DPFabricStrategy(stage=2, noise_multiplier=1.0, max_grad_norm=1.0, max_steps=steps, **strategy_kwargs)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    net = nn.Linear(6, 3)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(Rows(), batch_size=BATCH))
    if load is not None:
        fabric.load(load, {"model": model, "optimizer": optimizer})
    seen = []
    for _, (x, y, idx) in zip(range(steps - strategy.ledger.steps), loader):
        seen.append((strategy.ledger.steps, idx.tolist()))
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return fabric, strategy, model, optimizer, seen
