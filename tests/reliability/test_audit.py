"""Empirical auditing (issue #5, docs/reliability.md §5): the one-run audit's lower bound on ε stays below the
accountant's ε on a small model, and the audit has the power to see a run that is not private.

A sanity check of noise, clipping, sampling and accounting together, not a proof: auditing from the last model
only is loose, so a correct implementation typically shows a lower bound well below the accountant's ε."""

import math

import pytest
import torch
from torch import nn

from lightning_dpzero.accounting import calibrate_noise_multiplier
from lightning_dpzero.audit import audit_one_run, dirac_canaries, epsilon_lower_bound, p_value

FEATURES, M, N = 8, 1000, 1000
Q, STEPS, DELTA = 0.5, 50, 1e-5


def _setup(seed):
    g = torch.Generator().manual_seed(seed)
    x = nn.functional.pad(torch.randn(N, FEATURES, generator=g), (0, M))
    y = torch.randint(0, 2, (N,), generator=g)
    canaries = dirac_canaries(M, FEATURES, 2, scale=10.0, generator=g)
    torch.manual_seed(seed)
    return nn.Linear(FEATURES + M, 2, bias=False), (x, y), canaries


def _audit(sigma, seed=0, **kw):
    model, data, canaries = _setup(seed)
    return audit_one_run(model, data, canaries, steps=STEPS, sample_rate=Q, noise_multiplier=sigma,
                         max_grad_norm=1.0, lr=1.0, delta=DELTA, guesses=(50, 50),
                         generator=torch.Generator().manual_seed(100 + seed), **kw)


def test_lower_bound_stays_below_the_accountant():
    """σ calibrated to ε = 2 over the run: the empirical lower bound is positive (the canaries are seen) and at
    most the accountant's ε. Without noise the same audit gives ~3.5 (next test), so a run whose noise were
    missing, or whose clipping were off, would fail here."""
    sigma = calibrate_noise_multiplier(2.0, DELTA, Q, STEPS, "pld")
    result = _audit(sigma)
    assert result.epsilon == pytest.approx(2.0, rel=0.02)
    assert 0 < result.epsilon_lower_bound <= result.epsilon, result
    assert result.consistent


def test_audit_sees_a_run_that_is_not_private():
    """Power: with σ = 0 every guess is right and the lower bound is the most 100 guesses can show (~3.47)."""
    result = _audit(0.0)
    assert result.correct == result.guesses == 100
    assert result.epsilon_lower_bound > 3.4 and math.isinf(result.epsilon)


def test_black_box_loss_score_also_stays_below():
    sigma = calibrate_noise_multiplier(2.0, DELTA, Q, STEPS, "pld")
    result = _audit(sigma, score="loss")
    assert result.epsilon_lower_bound <= result.epsilon


def test_p_value_and_lower_bound():
    # δ = 0 and every guess right: P[Bin(r, p) >= r] = p^r, so the bound solves p^r = β exactly
    r, beta = 100, 0.05
    p = beta ** (1 / r)
    assert epsilon_lower_bound(M, r, r, 0.0, 1 - beta) == pytest.approx(math.log(p / (1 - p)), abs=2e-4)
    assert p_value(M, r, r, math.log(p / (1 - p)), 0.0) == pytest.approx(beta, rel=1e-6)
    # chance-level guessing rejects nothing; more correct guesses never lower the bound; δ only loosens it
    assert epsilon_lower_bound(M, r, 50, DELTA) == 0.0
    bounds = [epsilon_lower_bound(M, r, v, DELTA) for v in range(50, 101, 5)]
    assert bounds == sorted(bounds)
    assert epsilon_lower_bound(M, r, 90, DELTA) <= epsilon_lower_bound(M, r, 90, 0.0)
    assert p_value(M, r, 80, 1.0, DELTA) >= p_value(M, r, 80, 1.0, 0.0)
    with pytest.raises(ValueError):
        p_value(10, 20, 5, 1.0, DELTA)
