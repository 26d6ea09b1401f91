"""Tests for lightning_dpzero.accounting: ledger, epsilon (dp-accounting), tracker, calibration."""

import json
import math
import os
import time

import dp_accounting
import pytest
from hypothesis import given, settings, strategies as st

from lightning_dpzero.accounting import (
    EpsilonTracker,
    LedgerEntry,
    LedgerIntegrityError,
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_epsilon,
    epsilon_bound,
    epsilon_for,
    make_accountant,
    value_discretization_interval,
)


def _event(q, sigma, steps):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)


def _reference(runs, delta, kind):
    """Epsilon from accountants built here: dp-accounting's RdpAccountant, and for "pld" the smaller of it and
    a PLDAccountant on the grid the package chose (whose accuracy tests/accounting/test_epsilon_accuracy.py checks)."""
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.ComposedDpEvent([_event(*r) for r in runs]))
    if kind == "rdp":
        return rdp.get_epsilon(delta)
    h = value_discretization_interval([LedgerEntry(*r) for r in runs], delta)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=h)
    pld.compose(dp_accounting.ComposedDpEvent([_event(*r) for r in runs]))
    return min(pld.get_epsilon(delta), rdp.get_epsilon(delta))


# ------------------------------------------------------------------ accountants / known values
def test_make_accountant():
    assert isinstance(make_accountant("pld"), dp_accounting.pld.PLDAccountant)
    assert isinstance(make_accountant("rdp"), dp_accounting.rdp.RdpAccountant)
    with pytest.raises(ValueError, match="pld.*rdp"):
        make_accountant("gdp")


@pytest.mark.parametrize("kind", ["pld", "rdp"])
@pytest.mark.parametrize("runs", [
    [(0.01, 1.0, 1000)],
    [(0.004, 0.8, 1)],
    [(0.01, 1.0, 300), (0.02, 1.5, 200), (0.01, 0.7, 50), (0.01, 1.0, 10)],
])
def test_epsilon_matches_independent_accountant(kind, runs):
    led = PrivacyLedger(delta=1e-5, dataset_size=50_000, accountant=kind)
    for i, (q, s, n) in enumerate(runs):
        led.charge(q, s, sampler="shuffle" if i == 1 else "poisson", steps=n)
    ref = _reference(runs, 1e-5, kind)
    # rel 1e-9, not bit-identical: PLDAccountant starts from the identity PLD, whose composition truncates
    # up to 1e-15 more tail mass into the infinity mass; the package composes the runs alone
    assert led.epsilon() == pytest.approx(ref, rel=1e-9)
    assert compute_epsilon(led.entries, 1e-5, kind) == pytest.approx(ref, rel=1e-9)
    # the ledger's other accountant and another delta on demand
    other = "rdp" if kind == "pld" else "pld"
    assert led.epsilon(delta=1e-6, accountant=other) == pytest.approx(
        _reference(runs, 1e-6, other), rel=1e-9)


def test_composition_order_and_epsilon_monotone():
    a = compute_epsilon([LedgerEntry(0.01, 1.0, 100), LedgerEntry(0.05, 2.0, 100)], 1e-5)
    b = compute_epsilon([LedgerEntry(0.01, 1.0, 100)], 1e-5)
    assert a > b > 0


@pytest.mark.parametrize("q,sigma", [(0.004, 0.6), (0.01, 1.0), (0.05, 2.0), (0.05, 0.5), (1.0, 5.0)])
@pytest.mark.parametrize("steps", [1, 100, 10_000])
def test_pld_not_above_rdp(q, sigma, steps):
    """The chosen discretisation stays tighter than RDP (it would not, if it were too coarse)."""
    e = [LedgerEntry(q, sigma, steps)]
    assert compute_epsilon(e, 1e-5, "pld") <= compute_epsilon(e, 1e-5, "rdp")
    bound = epsilon_bound(e, 1e-5)
    assert bound.method == "pld" and bound.pld <= bound.rdp == compute_epsilon(e, 1e-5, "rdp")


def test_pld_discretisation_close_to_library_default():
    e = [LedgerEntry(0.01, 1.0, 10_000)]
    fine = compute_epsilon(e, 1e-5, "pld", value_discretization_interval=1e-4)
    ours = compute_epsilon(e, 1e-5, "pld")
    assert fine <= ours <= fine * 1.005


def test_compute_epsilon_errors_and_edges():
    assert compute_epsilon([], 1e-5) == 0.0
    assert compute_epsilon([LedgerEntry(0.01, 0.0, 3)], 1e-5) == math.inf
    assert compute_epsilon([LedgerEntry(0.01, 0.0, 3)], 1e-5, "rdp") == math.inf
    with pytest.raises(ValueError, match="delta"):
        compute_epsilon([LedgerEntry(0.01, 1.0, 3)], 1.5)
    with pytest.raises(ValueError, match="accountant"):
        compute_epsilon([LedgerEntry(0.01, 1.0, 3)], 1e-5, "moments")


# ------------------------------------------------------------------ calibration
@pytest.mark.parametrize("target", [0.5, 2.0, 8.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-6])
@pytest.mark.parametrize("q", [0.004, 0.05])
@pytest.mark.parametrize("steps", [1, 10, 1000])
def test_calibration_conservative_and_tight(target, delta, q, steps):
    sigma = calibrate_noise_multiplier(target, delta, q, steps)
    eps = epsilon_for(sigma, delta, q, steps)
    assert target * 0.99 <= eps <= target


def test_calibration_rdp():
    sigma = calibrate_noise_multiplier(4.0, 1e-5, 0.01, 500, accountant="rdp")
    assert 4.0 * 0.99 <= epsilon_for(sigma, 1e-5, 0.01, 500, accountant="rdp") <= 4.0
    assert sigma > calibrate_noise_multiplier(4.0, 1e-5, 0.01, 500)  # PLD is tighter: less noise


@pytest.mark.parametrize("kwargs,name", [
    (dict(target_epsilon=0.0), "target_epsilon"),
    (dict(target_epsilon=-1.0), "target_epsilon"),
    (dict(target_epsilon=math.inf), "target_epsilon"),
    (dict(delta=0.0), "delta"),
    (dict(delta=1.0), "delta"),
    (dict(sample_rate=0.0), "sample_rate"),
    (dict(sample_rate=1.5), "sample_rate"),
    (dict(steps=0), "steps"),
    (dict(steps=2.5), "steps"),
    (dict(accountant="gdp"), "accountant"),
    (dict(rtol=0.0), "rtol"),
])
def test_calibration_errors(kwargs, name):
    args = dict(target_epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=100)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        calibrate_noise_multiplier(**args)


def test_calibration_unreachable_target():
    # one full-batch step per 1e3 with almost no budget: more noise than SIGMA_MAX would be needed
    with pytest.raises(ValueError, match=r"target_epsilon=0.0001 needs sigma > 10000"):
        calibrate_noise_multiplier(1e-4, 1e-5, 1.0, 1000)


def test_calibration_target_met_by_any_noise_is_accepted_at_once(monkeypatch):
    """q = 1e-4 <= delta = 1e-3 and one step: an example is used with probability q <= delta, so the run is
    (0, delta)-DP whatever the noise. The target is accepted without any epsilon evaluation, with a warning
    saying why; it used to be refused after a search down to SIGMA_MIN."""
    from lightning_dpzero.accounting import calibration

    calls = []
    monkeypatch.setattr(calibration, "_epsilon_of_runs", lambda *a: calls.append(a) or math.inf)
    with pytest.warns(UserWarning, match=r"met by any noise multiplier: delta=0.001 is at least the probability "
                                         r"0.0001 = 1 - \(1 - q\)\^steps"):
        sigma = calibrate_noise_multiplier(1.0, 1e-3, 1e-4, 1)
    assert sigma == calibration.SIGMA_MIN and calls == []
    monkeypatch.undo()
    assert epsilon_for(sigma, 1e-3, 1e-4, 1) == 0.0
    # 1 - (1 - 1e-4)^11 > 1e-3: no longer trivial (sigma = 0.2: a sampled example is almost always visible)
    assert epsilon_for(0.2, 1e-3, 1e-4, 11) > 0.0
    # the same holds over several steps as long as 1 - (1 - q)^steps <= delta
    with pytest.warns(UserWarning, match="met by any noise multiplier"):
        assert calibrate_noise_multiplier(0.5, 1e-3, 1e-4, 10) == calibration.SIGMA_MIN


def test_calibration_target_met_at_the_least_noise_searched():
    from lightning_dpzero.accounting import calibration

    with pytest.warns(UserWarning, match=r"met even by the least noise searched: noise_multiplier=0.05 gives "
                                         r"epsilon <= \d"):
        sigma = calibrate_noise_multiplier(1e4, 1e-5, 0.01, 10)
    assert sigma == calibration.SIGMA_MIN
    assert epsilon_for(sigma, 1e-5, 0.01, 10) <= 1e4


def test_epsilon_for():
    assert epsilon_for(0.0, 1e-5, 0.01, 10) == math.inf
    assert epsilon_for(1.0, 1e-5, 0.01, 100) == pytest.approx(
        _reference([(0.01, 1.0, 100)], 1e-5, "pld"), rel=1e-9)
    with pytest.raises(ValueError, match="noise_multiplier"):
        epsilon_for(-1.0, 1e-5, 0.01, 10)


# ------------------------------------------------------------------ ledger
def _ledger():
    led = PrivacyLedger(delta=1e-5, dataset_size=60_000, run_id="run-1")
    led.charge(0.01, 1.0, steps=5)
    led.charge(0.01, 1.0)
    led.charge(0.01, 1.0, sampler="shuffle")
    led.charge(0.02, 1.0, steps=3)
    return led


def test_charge_merging_and_validation():
    led = _ledger()
    assert [(e.sample_rate, e.noise_multiplier, e.steps, e.sampler) for e in led.entries] == [
        (0.01, 1.0, 6, "poisson"), (0.01, 1.0, 1, "shuffle"), (0.02, 1.0, 3, "poisson")]
    assert led.steps == 10
    led.verify()
    for kwargs, name in [(dict(sample_rate=0.0), "sample_rate"), (dict(sample_rate=1.01), "sample_rate"),
                         (dict(noise_multiplier=-0.1), "noise_multiplier"),
                         (dict(noise_multiplier=math.nan), "noise_multiplier"),
                         (dict(steps=0), "steps"), (dict(sampler="uniform"), "sampler")]:
        args = dict(sample_rate=0.01, noise_multiplier=1.0)
        args.update(kwargs)
        with pytest.raises(ValueError, match=name):
            led.charge(**args)
    assert led.steps == 10
    for bad in [dict(delta=0.0), dict(dataset_size=0), dict(accountant="x")]:
        args = dict(delta=1e-5, dataset_size=10)
        args.update(bad)
        with pytest.raises(ValueError, match=next(iter(bad))):
            PrivacyLedger(**args)


def test_metadata_defaults():
    a, b = PrivacyLedger(1e-5, 100), PrivacyLedger(1e-5, 100)
    assert a.accountant == "pld" and len(a.run_id) == 32 and a.run_id != b.run_id
    assert not a.same_run(b)
    assert "dp_accounting" in a.versions and "torch" in a.versions
    assert a.epsilon() == 0.0


def test_sigma_zero_is_infinite():
    led = PrivacyLedger(1e-5, 100)
    led.charge(0.1, 1.0, steps=10)
    led.charge(0.1, 0.0)
    assert led.epsilon() == math.inf and led.epsilon(accountant="rdp") == math.inf
    assert EpsilonTracker().epsilon(led) == math.inf


def test_json_round_trip_and_equality():
    led = _ledger()
    back = PrivacyLedger.from_json(led.to_json())
    assert back == led and back.same_run(led) and back.head == led.head
    assert back.versions == led.versions
    assert back.epsilon() == led.epsilon()
    back.charge(0.02, 1.0)
    assert back != led and back.same_run(led)
    assert PrivacyLedger.from_dict(json.loads(json.dumps(led.to_dict()))) == led


def test_save_load_atomic(tmp_path, monkeypatch):
    path = tmp_path / "privacy_ledger.json"
    led = _ledger()
    led.save(path)
    assert PrivacyLedger.load(path) == led
    led.charge(0.02, 1.0)
    led.save(str(path))  # overwrite
    assert PrivacyLedger.load(path).steps == 11
    assert os.listdir(tmp_path) == ["privacy_ledger.json"]  # no temp files left

    def boom(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    led.charge(0.02, 1.0)
    with pytest.raises(OSError):
        led.save(path)
    assert PrivacyLedger.load(path).steps == 11  # old file intact
    assert os.listdir(tmp_path) == ["privacy_ledger.json"]


@pytest.mark.parametrize("edit", [
    lambda d: d["entries"][0].__setitem__("steps", d["entries"][0]["steps"] - 1),
    lambda d: d["entries"][2].__setitem__("steps", 1),
    lambda d: d["entries"][1].__setitem__("noise_multiplier", 2.0),
    lambda d: d["entries"][0].__setitem__("sample_rate", 0.001),
    lambda d: d["entries"][1].__setitem__("sampler", "poisson"),
    lambda d: d.__setitem__("delta", 1e-3),
    lambda d: d.__setitem__("dataset_size", 1_000_000),
    lambda d: d.__setitem__("accountant", "rdp"),
    lambda d: d.__setitem__("run_id", "run-2"),
    lambda d: d["entries"].pop(),
    lambda d: d["entries"].pop(0),
    lambda d: d.__setitem__("head", "0" * 64),
    lambda d: d.pop("entries"),
], ids=["steps0", "steps2", "sigma", "q", "sampler", "delta", "N", "accountant", "run_id",
        "drop_last", "drop_first", "head", "no_entries"])
def test_tampering_detected(tmp_path, edit):
    path = tmp_path / "privacy_ledger.json"
    _ledger().save(path)
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))
    with pytest.raises(LedgerIntegrityError):
        PrivacyLedger.load(path)
    assert issubclass(LedgerIntegrityError, ValueError)


def test_tampering_empty_ledger_and_in_memory():
    d = PrivacyLedger(1e-5, 100).to_dict()
    d["delta"] = 1e-2
    with pytest.raises(LedgerIntegrityError):
        PrivacyLedger.from_dict(d)
    led = _ledger()
    led.entries[0].steps = 1
    with pytest.raises(LedgerIntegrityError):
        led.verify()
    with pytest.raises(LedgerIntegrityError):
        PrivacyLedger.from_json("{not json")


# ------------------------------------------------------------------ tracker
@given(st.integers(min_value=1, max_value=10**7))
def test_grid_point(n):
    tr = EpsilonTracker()
    g = tr.grid_point(n)
    assert n <= g < tr.growth * n + 1
    assert tr.grid_point(g) == g
    assert tr.grid_point(n + 1) >= g
    if n <= tr.exact_below:
        assert g == n


_TRACKER = EpsilonTracker()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(0.01, 1.0), (0.004, 0.6), (0.05, 2.0)]),
       st.integers(min_value=1, max_value=20_000),
       st.booleans())
def test_tracker_never_below_exact(params, n, with_prefix):
    q, sigma = params
    led = PrivacyLedger(1e-5, 10_000)
    if with_prefix:
        led.charge(0.02, 1.3, steps=40)
    led.charge(q, sigma, steps=n)
    exact = led.epsilon()
    tracked = _TRACKER.epsilon(led)
    assert tracked >= exact
    g = _TRACKER.grid_point(n)
    at_grid = PrivacyLedger(1e-5, 10_000)
    for e in led.entries[:-1]:
        at_grid.charge(e.sample_rate, e.noise_multiplier, e.sampler, e.steps)
    at_grid.charge(q, sigma, steps=g)
    assert tracked == at_grid.epsilon()  # exactly the grid-point value
    assert _TRACKER.epsilon(led, exact=True) == exact


def test_tracker_exhaustive_small_and_cheap():
    tr = EpsilonTracker()
    led = PrivacyLedger(1e-5, 10_000)
    assert tr.epsilon(led) == 0.0
    prev, t_total, n_steps = 0.0, 0.0, 3000
    for n in range(1, n_steps + 1):
        led.charge(0.01, 1.0)
        t0 = time.perf_counter()
        e = tr.epsilon(led)
        t_total += time.perf_counter() - t0
        assert e >= prev  # reported epsilon never decreases as steps are added
        prev = e
        if n % 97 == 0 or n <= 60 or tr.grid_point(n) == n and n % 5 == 0:
            exact = led.epsilon()
            assert e >= exact
            if tr.grid_point(n) == n:
                assert e == exact
    assert e <= led.epsilon() * 1.02
    print(f"\nEpsilonTracker: {n_steps} steps, {t_total / n_steps * 1e3:.3f} ms/call amortised, "
          f"{tr.evaluations} dp-accounting evaluations")


def test_tracker_rdp_and_delta_override():
    led = _ledger()
    tr = EpsilonTracker()
    assert tr.epsilon(led, exact=True, accountant="rdp") == led.epsilon(accountant="rdp")
    assert tr.epsilon(led, accountant="rdp") >= led.epsilon(accountant="rdp")
    assert tr.epsilon(led, delta=1e-7) >= led.epsilon(delta=1e-7)
    with pytest.raises(ValueError, match="growth"):
        EpsilonTracker(growth=1.0)


# ------------------------------------------------------------------ budget
from lightning_dpzero.accounting import BudgetGuard  # noqa: E402


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_budget_guard_is_exact_step_by_step(kind):
    """Charging while the guard allows ends exactly at the last step with epsilon <= target."""
    prefix = [(0.05, 1.5, 7)]
    q, sigma, target = 0.02, 1.1, 1.6
    led = PrivacyLedger(1e-5, 1000, accountant=kind)
    led.charge(*prefix[0][:2], steps=prefix[0][2])
    guard = BudgetGuard(target)
    n0 = guard.steps_within_budget(led, q, sigma)
    assert n0 > 60  # beyond the tracker's exact_below: its grid is in play
    # the largest count that fits, by the independent accountant
    assert _reference(prefix + [(q, sigma, n0)], 1e-5, kind) <= target
    assert _reference(prefix + [(q, sigma, n0 + 1)], 1e-5, kind) > target
    led.charge(q, sigma, steps=n0 - 3)
    while guard.allows_next_step(led, q, sigma):
        led.charge(q, sigma)
    assert led.steps == 7 + n0
    assert led.epsilon() <= target < _reference(prefix + [(q, sigma, n0 + 1)], 1e-5, kind)
    assert guard.epsilon_after_next_step(led, q, sigma) == pytest.approx(
        _reference(prefix + [(q, sigma, n0 + 1)], 1e-5, kind), rel=1e-9)
    assert guard.steps_within_budget(led, q, sigma) == 0


def test_budget_guard_cheap_and_consistent_with_merging():
    guard = BudgetGuard(8.0)
    led = PrivacyLedger(1e-5, 60_000)
    led.charge(0.004, 0.8, steps=40_000)
    t0 = time.perf_counter()
    fits = guard.steps_within_budget(led, 0.004, 0.8)
    assert compute_epsilon([LedgerEntry(0.004, 0.8, 40_000 + fits)], 1e-5) <= 8.0
    assert compute_epsilon([LedgerEntry(0.004, 0.8, 40_000 + fits + 1)], 1e-5) > 8.0
    evaluations = guard.exact_evaluations
    assert evaluations <= 40
    for _ in range(1000):  # later questions are answered from the cached limit
        assert guard.allows_next_step(led, 0.004, 0.8)
    assert guard.exact_evaluations == evaluations
    assert time.perf_counter() - t0 < 30
    # the bound to log never shows more than the target while the ledger is within it
    full = PrivacyLedger(1e-5, 60_000)
    full.charge(0.004, 0.8, steps=40_000 + fits)
    assert full.epsilon() <= guard.epsilon_upper_bound(full) <= 8.0 < EpsilonTracker().epsilon(full)
    # another sampler or sigma opens a new entry: the guard asks about that ledger, not the merged one
    assert guard.steps_within_budget(led, 0.004, 0.8, sampler="shuffle") == fits


def test_budget_guard_sigma_zero_and_overspent_ledger():
    guard = BudgetGuard(1.0)
    led = PrivacyLedger(1e-5, 100)
    assert not guard.allows_next_step(led, 0.1, 0.0)
    assert guard.epsilon_after_next_step(led, 0.1, 0.0) == math.inf
    assert guard.steps_within_budget(led, 0.1, 0.0) == 0
    led.charge(0.5, 0.3, steps=5)  # already far over 1.0
    assert led.epsilon() > 1.0
    assert not guard.allows_next_step(led, 0.01, 5.0) and guard.steps_within_budget(led, 0.01, 5.0) == 0
    led0 = PrivacyLedger(1e-5, 100)
    led0.charge(0.1, 0.0)
    assert not BudgetGuard(100.0).allows_next_step(led0, 0.1, 1.0)
    with pytest.raises(ValueError, match="target_epsilon"):
        BudgetGuard(0.0)
