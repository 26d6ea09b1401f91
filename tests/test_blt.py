"""BLT correlated noise (``noise_mechanism="blt"``): its maths against dense matrices and brute force, its ε against
dp-accounting's Gaussian mechanism, the released noise's covariance over steps through the Trainer, calibration,
resume, and the refusals (``accounting/blt.py``, ``blt.py``, ``mechanism.correlated.CorrelatedNoise``)."""

from __future__ import annotations

import itertools

import dp_accounting
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dpzero.accounting import PrivacyLedger, compute_epsilon
from lightning_dpzero.accounting.blt import (BLTParams, blt_of, blt_sampler_kind, blt_sensitivity, optimize_blt,
                                             prefix_sum_error)
from lightning_dpzero.accounting.ledger import LedgerEntry
from lightning_dpzero.blt import BLTNoiseSource
from lightning_dpzero.noise import NoiseSource
from lightning_dpzero.sampling.cyclic import cyclic_parts
from test_correlated_noise import BATCH, N, Module, Rows, _released_noise, _trainer, fabric_loop

RANDOM = [BLTParams((0.9, 0.4), (0.3, 0.2)), BLTParams((0.7,), (0.5,)), BLTParams((0.99, 0.5, 0.1), (0.05, 0.4, 1.0))]


def _brute_sensitivity(params: BLTParams, steps: int, b: int) -> float:
    """max over every part p and every subset of its steps p, p+b, ... of ‖Σ C[:, t]‖ (dense C, float64)."""
    c, best = params.matrix(steps), 0.0
    for p in range(b):
        slots = list(range(p, steps, b))
        for r in range(1, len(slots) + 1):
            for subset in itertools.combinations(slots, r):
                best = max(best, float(np.linalg.norm(c[:, list(subset)].sum(1))))
    return best


@pytest.mark.parametrize("params", RANDOM)
@pytest.mark.parametrize("steps, b", [(9, 3), (10, 4), (7, 2), (5, 5)])
def test_the_sensitivity_is_the_worst_participation_pattern(params, steps, b):
    assert blt_sensitivity(params, steps, b) == pytest.approx(_brute_sensitivity(params, steps, b), rel=1e-12)


@pytest.mark.parametrize("params", RANDOM)
def test_the_recursion_releases_c_inverse_z(params):
    steps = 12
    src = BLTNoiseSource(NoiseSource(3, False, replicated=True, rank=0), params)
    nu = []
    for _ in range(steps):
        src.begin_step()
        nu.append(torch.cat([src.normal((5,), "cpu"), src.normal((2, 3), "cpu").flatten()]))
    ref = NoiseSource(3, False, replicated=True, rank=0)
    z = torch.stack([torch.cat([ref.normal((5,), "cpu"), ref.normal((2, 3), "cpu").flatten()])
                     for _ in range(steps)]).double()
    expected = np.linalg.solve(params.matrix(steps), z.numpy())
    np.testing.assert_allclose(torch.stack(nu).double().numpy(), expected, rtol=0, atol=2e-5)
    np.testing.assert_allclose(params.inverse_coefficients(steps), np.linalg.inv(params.matrix(steps))[:, 0],
                               rtol=0, atol=1e-12)


def test_the_optimised_blt_beats_independent_noise_and_its_start():
    from lightning_dpzero.accounting.blt import _initial

    for steps, b in [(60, 6), (200, 10)]:
        found = optimize_blt(steps, b)
        loss = blt_sensitivity(found, steps, b) ** 2 * prefix_sum_error(found, steps)
        sgd = -(-steps // b) * (steps + 1) / 2  # C = I, not amplified
        u, v = _initial(steps, 4)
        start = BLTParams(tuple(1 / (1 + np.exp(-u))), tuple(np.exp(v)))
        assert loss < 0.5 * sgd
        assert loss <= blt_sensitivity(start, steps, b) ** 2 * prefix_sum_error(start, steps)
        assert optimize_blt(steps, b) == found  # deterministic (cached, and the same on every rank)


def test_epsilon_is_dp_accountings_gaussian_mechanism_at_sigma_over_the_sensitivity():
    params = BLTParams((0.8, 0.3), (0.2, 0.1))
    kind = blt_sampler_kind(4, params)
    assert blt_of(kind) == (4, params)
    ledger = PrivacyLedger(delta=1e-5, dataset_size=100)
    ledger.charge(0.25, 3.0, kind, steps=10)
    delta_10 = blt_sensitivity(params, 10, 4)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(
        dp_accounting.GaussianDpEvent(3.0 / delta_10)).get_epsilon(1e-5)
    assert ledger.epsilon() == pytest.approx(pld, rel=0.01)
    # no amplification: the same stream at q = 0.01 costs the same; more steps cost more
    assert compute_epsilon([LedgerEntry(0.01, 3.0, 10, kind)], 1e-5) == pytest.approx(ledger.epsilon(), rel=1e-12)
    assert compute_epsilon([LedgerEntry(0.25, 3.0, 11, kind)], 1e-5) > ledger.epsilon()
    # a second entry of the stream (another σ) is refused: it would be accounted as a separate release
    with pytest.raises(ValueError, match="one Gaussian mechanism at one σ"):
        ledger.charge(0.25, 2.5, kind)
    # entries written by hand are merged, never accounted as weaker than one stream of their steps
    split = compute_epsilon([LedgerEntry(0.25, 3.0, 6, kind), LedgerEntry(0.25, 3.0, 4, "poisson"),
                             LedgerEntry(0.25, 3.0, 4, kind)], 1e-5)
    assert split >= ledger.epsilon()


def test_the_released_noise_has_covariance_c_inverse_c_inverse_transposed_over_steps():
    steps, samples = 6, []
    for seed in range(3):
        model = Module(zero_loss=True, width=400)
        trainer = _trainer(steps, noise_mechanism="blt", bands=3, seed=seed)
        trainer.fit(model, DataLoader(Rows(), batch_size=BATCH))
        samples.append(_released_noise(model, std=1.0 / 4))  # σ C / B_exp
    params = blt_of(trainer.strategy.ledger.entries[0].sampler)[1]
    assert params == optimize_blt(steps, 3)  # optimised for the planned steps
    inv = np.linalg.inv(params.matrix(steps))
    nu = np.concatenate(samples, axis=1)  # (steps, 3 · 2,800 coordinates)
    np.testing.assert_allclose(nu @ nu.T / nu.shape[1], inv @ inv.T, atol=0.06)
    assert abs((inv @ inv.T)[1, 0]) > 0.1


def test_calibration_the_budget_and_the_parts():
    from lightning_dpzero.planner import plan_run

    model = Module()
    trainer = _trainer(12, sigma=None, target_epsilon=4.0, noise_mechanism="blt", bands=6, seed=2)
    trainer.fit(model, DataLoader(Rows(), batch_size=BATCH))
    ledger, plan = trainer.strategy.ledger, trainer.strategy.plan
    assert ledger.steps == 12 and 4.0 * 0.99 <= ledger.epsilon() <= 4.0
    b, params = blt_of(ledger.entries[0].sampler)
    assert b == 6 and ledger.noise_mechanism["theta"] == list(params.theta)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(
        dp_accounting.GaussianDpEvent(plan.noise_multiplier / blt_sensitivity(params, 12, 6))).get_epsilon(1e-5)
    assert ledger.epsilon() == pytest.approx(pld, rel=0.01)
    parts = cyclic_parts(N, 6, ledger.noise_mechanism["partition_seed"])
    assert all(sorted(rows) == sorted(parts[t % 6].tolist()) for t, rows in enumerate(model.seen))  # q_b = 1
    planned = plan_run(N, BATCH, max_steps=12, target_epsilon=4.0, bands=6, noise_mechanism="blt")
    assert planned.plan.noise_multiplier == pytest.approx(plan.noise_multiplier, rel=1e-9)


def test_a_resume_continues_the_noise_state_with_fresh_draws(tmp_path, monkeypatch):
    std = 1.0 / 4
    first = Module(zero_loss=True)
    trainer = _trainer(3, seed=5, noise_mechanism="blt", bands=3)
    trainer.fit(first, DataLoader(Rows(), batch_size=BATCH))
    trainer.save_checkpoint(tmp_path / "ckpt")
    params = blt_of(trainer.strategy.ledger.entries[0].sampler)[1]
    nu = _released_noise(first, std)

    draws = []
    normal = NoiseSource.normal
    monkeypatch.setattr(NoiseSource, "normal", lambda self, *a: draws.append(normal(self, *a)) or draws[-1])
    resumed = Module(zero_loss=True)
    again = _trainer(5, root=tmp_path, seed=5, noise_mechanism="blt", bands=3)  # other max_steps: the ledger's θ, ω
    again.fit(resumed, DataLoader(Rows(), batch_size=BATCH), ckpt_path=tmp_path / "ckpt")
    assert again.strategy.ledger.entries[0].sampler == blt_sampler_kind(3, params)
    after = _released_noise(resumed, std)
    per_step = len(draws) // 2
    z = np.stack([torch.cat([d.flatten() for d in draws[i * per_step:(i + 1) * per_step]]).double().numpy()
                  for i in (0, 1)])
    # C ν = z over the whole stream: steps 4 and 5 continue the first three
    c = params.matrix(5)
    whole = np.concatenate([nu, after])
    np.testing.assert_allclose((c @ whole)[3:], z, rtol=0, atol=2e-4)
    assert not np.allclose(after[0], nu[0])


@pytest.mark.parametrize("settings, match", [
    ({"noise_mechanism": "blt"}, "needs bands=b"),
    ({"noise_mechanism": "blt", "bands": 1}, "bands=b >= 2"),
    ({"noise_mechanism": "blt", "bands": 3, "poisson_sampling": False}, "poisson_sampling=False"),
])
def test_settings_blt_does_not_cover_are_refused(settings, match):
    from lightning_dpzero import DPDeepSpeedStrategy

    with pytest.raises(ValueError, match=match):
        DPDeepSpeedStrategy(**settings)


@pytest.mark.parametrize("now, match", [({"noise_mechanism": "banded-mf", "bands": 3}, "'blt'"),
                                        ({"noise_mechanism": "blt", "bands": 3, "sigma": 2.0}, "one Gaussian")])
def test_a_resume_with_another_mechanism_or_sigma_is_refused(tmp_path, now, match):
    trainer = _trainer(2, seed=5, noise_mechanism="blt", bands=3)
    trainer.fit(Module(), DataLoader(Rows(), batch_size=BATCH))
    trainer.save_checkpoint(tmp_path / "ckpt")
    model = Module()
    with pytest.raises(ValueError, match=match):
        _trainer(4, root=tmp_path, seed=5, **now).fit(model, DataLoader(Rows(), batch_size=BATCH),
                                                        ckpt_path=tmp_path / "ckpt")
    assert len(model.params) <= 1  # nothing trained


def test_a_fabric_loop_resumed_with_other_max_steps_continues_the_ledgers_blt(tmp_path):
    """A Fabric loop fixes its plan (θ, ω optimised for its own max_steps) before ``fabric.load``; the load then
    re-keys the plan to the ledger's BLT, and the noise state continues."""
    def loop(steps, load=None):
        return fabric_loop(steps, load, seed=3, noise_mechanism="blt", bands=3)[:4]

    fabric, strategy, model, optimizer = loop(2)
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    assert (tmp_path / "ckpt" / "privacy_noise_rank0.pt").is_file()
    kind = strategy.ledger.entries[0].sampler
    assert kind != blt_sampler_kind(3, optimize_blt(6, 3))  # the resumed loop alone would optimise another BLT
    _, resumed, _, _ = loop(6, load=tmp_path / "ckpt")
    assert resumed.ledger.steps == 6 and [e.sampler for e in resumed.ledger.entries] == [kind]
    assert resumed.mechanism.correlated.source.step == 6


def test_a_run_gets_the_blt_of_its_planned_steps_at_most_the_cap(monkeypatch):
    from lightning_dpzero.accounting import blt

    asked = []
    monkeypatch.setattr(blt, "optimize_blt", lambda steps, b: asked.append((steps, b)) or BLTParams((0.5,), (0.1,)))
    blt.blt_for_run(240, 12, 11)
    blt.blt_for_run(None, 12, 11)  # no planned length: ten epochs
    blt.blt_for_run(10**7, 1000, 100)  # a long run: seconds at the start of the fit, not minutes
    assert asked == [(240, 11), (120, 11), (blt.HORIZON_CAP, 100)]
