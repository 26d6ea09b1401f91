"""BandMF (amplified banded matrix factorization): the released noise's covariance, b=1 equals DP-SGD, the
accounting, the cyclic parts and resume mid-band (lightning_dpzero.banded_mf, lightning_dpzero.sampling.cyclic)."""


import dp_accounting
import numpy as np
import pytest
import torch

from lightning_dpzero.accounting.accountants import compute_epsilon
from lightning_dpzero.banded_mf import (BandedNoiseSource, banded_accounting_steps, banded_coefficients,
                                        banded_matrix, check_banded_supported, expected_noise_covariance)
from lightning_dpzero.sampling.cyclic import CyclicPoissonBatchSampler, cyclic_parts
from lightning_dpzero.noise import NoiseSource, make_noise_pre_hook


def _released_noise(source, steps, std, dim):
    """Run the real noise pre-hook with zero gradients and SGD(lr=1): the parameter's change per step is minus the
    released noise. Returns (steps, dim) float64."""
    p = torch.nn.Parameter(torch.zeros(dim))
    opt = torch.optim.SGD([p], lr=1.0)
    opt.register_step_pre_hook(make_noise_pre_hook(lambda: (1.0, std), source, lambda: None))
    out = []
    for _ in range(steps):
        with torch.no_grad():
            p.zero_()  # (from zero each step: the change is the noise exactly, no float32 rounding of a sum)
        p.grad = torch.zeros_like(p)
        opt.step()
        out.append(-p.detach().double())
    return torch.stack(out).numpy()


def test_coefficients_are_the_normalised_inverse_square_root_series():
    c = banded_coefficients(4)
    raw = np.array([1.0, 0.5, 0.375, 0.3125])
    np.testing.assert_allclose(c, raw / np.linalg.norm(raw), rtol=0, atol=1e-15)
    cols = np.linalg.norm(banded_matrix(8, 4), axis=0)
    np.testing.assert_allclose(cols[:5], 1.0, atol=1e-12)  # unit column norms (away from the end)
    assert np.all(cols <= 1 + 1e-12)
    with pytest.raises(ValueError, match="bands"):
        banded_coefficients(0)


@pytest.mark.parametrize("bands", [2, 4])
def test_released_noise_covariance_is_sigma2_c2_cinv_cinvT(bands):
    steps, dim, std = 6, 20000, 0.7   # std = σ·C_clip (B_exp = 1)
    samples = np.concatenate([_released_noise(BandedNoiseSource(NoiseSource(s, False, True, 0), bands), steps,
                                              std, dim) for s in range(3)], axis=1)  # coordinates x seeds: i.i.d.
    n = samples.shape[1]
    emp = samples @ samples.T / n
    expected = expected_noise_covariance(steps, bands, std)
    # each entry is a mean of n products with variance Σ_ii Σ_jj + Σ_ij²: 6 standard errors
    se = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected ** 2) / n)
    assert np.all(np.abs(emp - expected) < 6 * se), np.max(np.abs(emp - expected) / se)
    # and the correlations are really there (DP-SGD's identity would fail this)
    assert abs(expected[1, 0]) > 10 * se[1, 0]


def test_one_band_is_dp_sgd_exactly():
    a = _released_noise(BandedNoiseSource(NoiseSource(3, False, False, 1), 1), 5, 0.9, 7)
    b = _released_noise(NoiseSource(3, False, False, 1), 5, 0.9, 7)
    assert np.array_equal(a, b)


def test_epsilon_is_dp_accounting_of_rounds_at_the_part_rate():
    q, sigma, steps, bands, delta = 0.01, 1.0, 1000, 4, 1e-5
    q_b, rounds = bands * q, banded_accounting_steps(steps, bands)
    assert rounds == 250 and banded_accounting_steps(1001, 4) == 251

    class Entry:
        sample_rate, noise_multiplier, steps = q_b, sigma, rounds

    ours = compute_epsilon([Entry], delta, "pld")
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q_b, dp_accounting.GaussianDpEvent(sigma)), rounds))
    ref = acc.get_epsilon(delta)
    assert ours <= ref * 1.01 and ours >= ref * 0.95, (ours, ref)


def test_refusals():
    with pytest.raises(ValueError, match="exceeds the 10 steps per epoch"):
        check_banded_supported(11, 10)
    with pytest.raises(ValueError, match="poisson_sampling=True"):
        check_banded_supported(2, 10, poisson_sampling=False)
    check_banded_supported(1, 10, poisson_sampling=False)
    with pytest.raises(ValueError, match="q_b"):
        CyclicPoissonBatchSampler(num_samples=100, sample_rate=0.3, bands=4, partition_seed=0)


def test_parts_never_overlap_and_cover_every_example():
    for n, b in [(10, 3), (101, 7), (64, 1)]:
        parts = cyclic_parts(n, b, partition_seed=5)
        allidx = np.concatenate(parts)
        assert len(allidx) == n and len(set(allidx.tolist())) == n and set(allidx.tolist()) == set(range(n))
        assert all(np.array_equal(x, y) for x, y in zip(parts, cyclic_parts(n, b, 5)))
        # each example's part is its own draw: one more example leaves every other example's part as it was (the
        # coupling add/remove adjacency needs; equal pieces of a permutation would move the cuts)
        more = cyclic_parts(n + 1, b, partition_seed=5)
        assert all(np.array_equal(x, y[y < n]) for x, y in zip(parts, more))
    sizes = [len(p) for p in cyclic_parts(40_000, 4, 1)]
    assert all(abs(k - 10_000) < 400 for k in sizes)  # about N/b each (sd 87)
    # two ranks: each samples only its shard of the step's part; the union is the part's sample
    n, b = 60, 3
    parts = cyclic_parts(n, b, 9)
    samplers = [CyclicPoissonBatchSampler(n, 0.1, b, 9, num_replicas=2, rank=r, seed=1) for r in range(2)]
    for t, batches in enumerate(zip(*samplers)):
        got = set(batches[0]) | set(batches[1])
        assert not set(batches[0]) & set(batches[1])
        assert got <= set(parts[t % b].tolist())
        assert all(i % 2 == r for r in range(2) for i in batches[r])


def test_resume_mid_band_continues_the_noise_exactly():
    bands, std = 4, 1.3

    def run(steps, src):
        return _released_noise(src, steps, std, 5)

    whole = run(7, BandedNoiseSource(NoiseSource(0, False, True, 0), bands))
    first = BandedNoiseSource(NoiseSource(0, False, True, 0), bands)
    head = run(3, first)
    state = first.state_dict()
    # the resumed run's z stream continues where the first stopped (what a resumed seeded stream would draw)
    base = NoiseSource(0, False, True, 0)
    for _ in range(3):
        base.normal((5,), "cpu")
    resumed = BandedNoiseSource(base, bands)
    resumed.load_state_dict(state)
    tail = run(4, resumed)
    np.testing.assert_array_equal(np.concatenate([head, tail]), whole)
    # without the history the continuation differs: the buffers matter
    fresh = NoiseSource(0, False, True, 0)
    for _ in range(3):
        fresh.normal((5,), "cpu")
    assert not np.allclose(run(4, BandedNoiseSource(fresh, bands)), whole[3:])
    with pytest.raises(ValueError, match="bands=4"):
        BandedNoiseSource(NoiseSource(0, False, True, 0), 3).load_state_dict(state)


def test_banded_event_feeds_the_existing_accountant_and_calibration():
    from lightning_dpzero.accounting.banded import banded_entries, banded_event
    from lightning_dpzero.accounting.calibration import calibrate_noise_multiplier, epsilon_for

    ev = banded_event(0.01, 1.0, 1000, 4)
    assert (ev.sample_rate, ev.steps) == (0.04, 250)
    sigma = calibrate_noise_multiplier(2.0, 1e-5, ev.sample_rate, ev.steps)
    assert 1.98 <= epsilon_for(sigma, 1e-5, ev.sample_rate, ev.steps) <= 2.0

    class E:
        sample_rate, noise_multiplier, steps = 0.01, 1.0, 1000
    assert compute_epsilon(banded_entries([E], 4), 1e-5) == compute_epsilon([ev], 1e-5)
    # b = 1 is DP-SGD's accounting
    assert compute_epsilon(banded_entries([E], 1), 1e-5) == compute_epsilon([E], 1e-5)
    with pytest.raises(ValueError, match="q_b"):
        banded_event(0.3, 1.0, 10, 4)
