"""Bounded micro-batches (``max_micro_batch_size = b``): no micro-batch above b, the kept subset uniform, and the
truncation's δ accounted (docs/privacy.md, *Bounded micro-batches*): p(T) = T·Σ_r P[Bin(n_r + 1, q) > K·b],
the reported ε the smallest with δ_M(ε) + (1 + e^ε)·p(T) <= δ, in every accountant, the calibration, the budget
stop and the plan."""

import json
import math
from fractions import Fraction
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from scipy import stats

from lightning_dpzero import DPDeepSpeedStrategy
from lightning_dpzero.accounting import (BudgetGuard, LedgerEntry, LedgerIntegrityError, PrivacyLedger,
                                         calibrate_noise_multiplier, compute_epsilon, epsilon_for)
from lightning_dpzero.accounting.truncation import (MicroBatchBound, exceed_probability, rank_sizes_of,
                                                    smallest_micro_batch_bound, truncation_share)
from lightning_dpzero.planner import plan_run
from lightning_dpzero.accounting.plan import PrivacyPlan
from lightning_dpzero.sampling import DistributedPoissonBatchSampler, private_dataloader

DATA = Path(__file__).parents[1] / "data"


# ------------------------------------------------------------------------------------------------ the sampler
def _steps(num_samples, q, world, k, b, seed, secure=False, shard_sizes=None, epochs=3, steps_per_epoch=None):
    """``out[rank]`` = that rank's optimizer steps, each the list of its K micro-batches."""
    out = []
    for rank in range(world):
        s = DistributedPoissonBatchSampler(num_samples, q, world, rank, k, steps_per_epoch, seed=seed,
                                           secure_mode=secure, shard_sizes=shard_sizes, max_micro_batch_size=b)
        steps = []
        for epoch in range(epochs):
            s.set_epoch(epoch)
            batches = list(s)
            steps += [batches[i:i + k] for i in range(0, len(batches), k)]
        out.append(steps)
    return out


@pytest.mark.parametrize("k,b", [(1, 15), (3, 6)])
@pytest.mark.parametrize("shard_sizes", [None, (70, 130)])
@pytest.mark.parametrize("secure", [False, True])
def test_no_micro_batch_above_the_bound(k, b, shard_sizes, secure):
    """Two ranks (equal or unequal shards), K = 1 and 3, seeded and CSPRNG: over many steps no micro-batch holds
    more than b, and the bound binds (steps cut to exactly K·b) often, so a sampler ignoring b fails."""
    cut = total = 0
    for seed in range(3 if secure else 20):
        for rank_steps in _steps(200, 0.2, 2, k, b, seed, secure, shard_sizes):
            for step in rank_steps:
                sizes = [len(mb) for mb in step]
                assert max(sizes) <= b, sizes
                flat = [i for mb in step for i in mb]
                assert flat == sorted(set(flat))  # kept in order, no repeats
                cut += sum(sizes) == k * b
                total += 1
    assert 0.05 * total < cut < total  # the bound binds, and not always


@pytest.mark.parametrize("secure", [False, True])
def test_the_kept_subset_is_uniform(secure):
    """One rank of 12 examples, q = 0.75, b = 4: each example is kept with probability
    q·E[min(1, 4 / (1 + Bin(11, q)))] (computed exactly), every one alike (within 6 binomial standard deviations
    over 4000 steps, and a chi-square test of equal counts). Keeping the first K·b, or not truncating, fails."""
    n, q, b, steps = 12, 0.75, 4, 4000
    counts = np.zeros(n)
    s = DistributedPoissonBatchSampler(n, q, 1, 0, 1, steps_per_epoch=steps, seed=7, secure_mode=secure,
                                       max_micro_batch_size=b)
    for batch in s:
        assert len(batch) <= b
        counts[batch] += 1
    qf = Fraction(q)
    kept = qf * sum(math.comb(n - 1, j) * qf**j * (1 - qf) ** (n - 1 - j) * min(Fraction(1), Fraction(b, j + 1))
                    for j in range(n))
    p = float(kept)
    sd = math.sqrt(steps * p * (1 - p))
    assert np.all(np.abs(counts - steps * p) <= 6 * sd), (counts, steps * p)
    assert stats.chisquare(counts).pvalue > 1e-4


def test_the_sampler_truncates_exactly_when_a_draw_exceeds_k_b():
    """The same seed with and without a bound: identical steps until the first draw above K·b, which the bounded
    sampler cuts to a K·b-subset of it."""
    n, q, k, b = 100, 0.3, 2, 8
    free = _steps(n, q, 1, k, None, 3, epochs=1, steps_per_epoch=40)[0]
    cut = _steps(n, q, 1, k, b, 3, epochs=1, steps_per_epoch=40)[0]
    for a, c in zip(free, cut):
        fa, fc = [i for mb in a for i in mb], [i for mb in c for i in mb]
        if len(fa) > k * b:
            assert len(fc) == k * b and set(fc) < set(fa)
            break
        assert a == c
    else:
        pytest.fail("no draw above K·b in 40 steps: the case does not test truncation")


# ------------------------------------------------------------------------------------------------ p(T)
def _exact_tail(n: int, q: float, cap: int) -> float:
    """P[Bin(n, q) > cap] in exact rational arithmetic."""
    qf = Fraction(q)
    return float(1 - sum(math.comb(n, j) * qf**j * (1 - qf) ** (n - j) for j in range(cap + 1)))


@pytest.mark.parametrize("q,cap,sizes", [(0.1, 12, (40, 60)), (0.01, 20, (500, 501, 499)), (0.3, 5, (7,)),
                                         (0.05, 40, (200, 300))])
def test_exceed_probability_against_exact_binomials(q, cap, sizes):
    """Σ_r P[Bin(n_r + 1, q) > cap] against the exact sum of the binomial pmf (Fractions), tiny tails included."""
    expected = sum(_exact_tail(n + 1, q, cap) for n in sizes)
    assert exceed_probability(q, cap, sizes) == pytest.approx(expected, rel=1e-9, abs=1e-300)
    assert MicroBatchBound(cap, 1, sizes).exceed_probability(q) == exceed_probability(q, cap, sizes)


def test_exceed_probability_bounds_the_samplers_truncation_rate():
    """Monte Carlo on the sampler itself: the rate of steps on which some rank's draw exceeds K·b is at most the
    per-step exceed probability (which uses n_r + 1), and close to the exact rate 1 - Π_r P[Bin(n_r, q) <= K·b]."""
    n, q, k, b, shards, steps = 120, 0.25, 2, 8, (50, 70), 3000
    over = np.zeros(steps, dtype=bool)
    for rank in range(2):
        s = DistributedPoissonBatchSampler(n, q, 2, rank, k, steps_per_epoch=steps, seed=11, shard_sizes=shards)
        batches = list(s)
        over |= np.array([len(batches[i]) + len(batches[i + 1]) > k * b for i in range(0, len(batches), k)])
    exact = 1 - np.prod([1 - _exact_tail(m, q, k * b) for m in shards])
    sd = math.sqrt(exact * (1 - exact) / steps)
    assert abs(over.mean() - exact) <= 5 * sd
    assert over.mean() <= MicroBatchBound(b, k, shards).exceed_probability(q) + 5 * sd
    assert rank_sizes_of(n, 2, shards) == shards and rank_sizes_of(101, 2) == (51, 50)
    assert DistributedPoissonBatchSampler(101, 0.1, 2, 1).rank_sizes == (51, 50)


# ------------------------------------------------------------------------------------------------ ε with a bound
Q, SIGMA, T, DELTA, SIZES = 0.01, 1.0, 1000, 1e-5, (5000, 5000)


def _independent_delta(accountant: str, eps: float) -> float:
    """δ_M(ε) of T untruncated steps straight from dp-accounting (a finer PLD grid than the package's)."""
    acc = (dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4) if accountant == "pld"
           else dp_accounting.rdp.RdpAccountant())
    acc.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA)), T)
    return acc.get_delta(eps)


def _binding_cap(accountant: str) -> int:
    """The smallest K·b whose truncation takes at most 40 % of δ at the untruncated ε: it matters, and fits."""
    eps0 = compute_epsilon([LedgerEntry(Q, SIGMA, T)], DELTA, accountant)
    cap = next(c for c in range(60, 200) if truncation_share(eps0, T * exceed_probability(Q, c, SIZES)) <= 0.4 * DELTA)
    assert truncation_share(eps0, T * exceed_probability(Q, cap, SIZES)) > 0.05 * DELTA
    return cap


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_epsilon_with_a_bound_against_an_independent_delta(accountant):
    """At the reported ε, δ_M(ε) + (1 + e^ε)·p(T) <= δ with δ_M from dp-accounting directly and p(T) from exact
    binomials; 3 % below it the sum is above δ (the bound is tight); and it is above the untruncated ε."""
    cap = _binding_cap(accountant)
    ledger = PrivacyLedger(DELTA, sum(SIZES), accountant)
    ledger.charge(Q, SIGMA, steps=T, bound=MicroBatchBound(cap // 2, 2, SIZES))  # K = 2, b = cap / 2
    if cap % 2:
        ledger = PrivacyLedger(DELTA, sum(SIZES), accountant)
        ledger.charge(Q, SIGMA, steps=T, bound=MicroBatchBound(cap, 1, SIZES))
    bound = ledger.epsilon_bound()
    eps = bound.epsilon
    p = T * sum(_exact_tail(n + 1, Q, cap) for n in SIZES)
    assert _independent_delta(accountant, eps) + (1 + math.exp(eps)) * p <= DELTA * (1 + 1e-9)
    below = eps * 0.97
    assert _independent_delta(accountant, below) + (1 + math.exp(below)) * p > DELTA
    assert eps > compute_epsilon([LedgerEntry(Q, SIGMA, T)], DELTA, accountant)
    assert bound.truncation_delta == pytest.approx((1 + math.exp(eps)) * p, rel=1e-6)
    # the tracker (logged ε) is never below it
    from lightning_dpzero.accounting import EpsilonTracker
    assert EpsilonTracker().epsilon(ledger) >= eps * (1 - 1e-9)


def test_a_bound_that_never_binds_costs_nothing():
    """K·b above every shard: p = 0 and ε is the untruncated one exactly."""
    ledger = PrivacyLedger(DELTA, sum(SIZES))
    ledger.charge(Q, SIGMA, steps=T, bound=MicroBatchBound(5001, 1, SIZES))
    assert ledger.epsilon() == compute_epsilon([LedgerEntry(Q, SIGMA, T)], DELTA)


def test_calibration_and_the_plan_take_the_truncation_from_delta():
    """σ calibrated with the truncation meets the target with δ_M(target) + (1 + e^target)·p(T) <= δ
    (independent δ_M), needs more noise than without, and the plan, ``plan_run`` and the ledger of the run agree."""
    target, n, k, world, batch = 2.0, 10_000, 1, 2, 50
    q = batch * world * k / n
    sizes = rank_sizes_of(n, world)
    b = next(b for b in range(batch, 4 * batch) if truncation_share(
        target, T * MicroBatchBound(b, k, sizes).exceed_probability(q)) <= 0.4 * DELTA)
    bound = MicroBatchBound(b, k, sizes)
    p = T * bound.exceed_probability(q)
    assert truncation_share(target, p) > 0.01 * DELTA  # it matters
    sigma = calibrate_noise_multiplier(target, DELTA, q, T, truncation=p)
    assert sigma > calibrate_noise_multiplier(target, DELTA, q, T)
    assert target * 0.99 <= epsilon_for(sigma, DELTA, q, T, truncation=p) <= target
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), T)
    assert acc.get_delta(target) + (1 + math.exp(target)) * p <= DELTA

    plan = PrivacyPlan.build(dataset_size=n, sample_rate=q, sampler_kind="poisson", accumulate_grad_batches=k,
                             micro_batches_per_epoch=T, max_steps=T, max_epochs=None, noise_multiplier=None,
                             target_epsilon=target, delta=DELTA, micro_batch_bound=bound)
    assert plan.noise_multiplier == sigma
    assert plan.truncation_delta == pytest.approx(truncation_share(epsilon_for(sigma, DELTA, q, T, truncation=p), p))
    run = plan_run(n, batch, devices=world, max_steps=T, target_epsilon=target, delta=DELTA, max_micro_batch_size=b)
    assert run.plan.noise_multiplier == sigma and run.plan.micro_batch_bound == bound
    assert DistributedPoissonBatchSampler(n, q, world, 0, k).rank_sizes == sizes  # what fix_plan records
    ledger = PrivacyLedger(DELTA, n)
    for _ in range(3):
        ledger.charge(q, sigma, bound=bound)
    ledger.charge(q, sigma, steps=T - 3, bound=bound)
    assert len(ledger.entries) == 1 and ledger.entries[0].micro_batch_bound == bound
    assert ledger.epsilon() == epsilon_for(sigma, DELTA, q, T, truncation=p) <= target


def test_the_budget_stop_counts_the_truncation():
    """The budget's last allowed step with a bound: ε (with the truncation) within the target there and over it
    one step later; fewer steps fit than without the bound."""
    target, q, sigma = 1.5, Q, SIGMA
    bound = MicroBatchBound(_binding_cap("pld"), 1, SIZES)
    empty = PrivacyLedger(DELTA, sum(SIZES))
    fits = BudgetGuard(target).steps_within_budget(empty, q, sigma, bound=bound)
    assert fits < BudgetGuard(target).steps_within_budget(empty, q, sigma)

    def eps(steps):
        return compute_epsilon([LedgerEntry.of(q, sigma, steps, bound=bound)], DELTA)

    assert eps(fits) <= target < eps(fits + 1)
    ledger = PrivacyLedger(DELTA, sum(SIZES))
    ledger.charge(q, sigma, steps=fits - 1, bound=bound)
    guard = BudgetGuard(target)
    assert guard.allows_next_step(ledger, q, sigma, bound=bound)
    ledger.charge(q, sigma, bound=bound)
    assert not guard.allows_next_step(ledger, q, sigma, bound=bound)
    assert guard.epsilon_after_next_step(ledger, q, sigma, bound=bound) == eps(fits + 1)


# ------------------------------------------------------------------------------------------------ refusals
def test_a_bound_taking_over_half_of_delta_is_refused_naming_the_smallest_that_fits():
    n, batch, world, k, steps, target = 60_000, 64, 2, 2, 702, 8.0
    q = batch * world * k / n
    sizes = rank_sizes_of(n, world)
    smallest = smallest_micro_batch_bound(q, k, sizes, steps, DELTA, target)
    share = [truncation_share(target, steps * MicroBatchBound(b, k, sizes).exceed_probability(q))
             for b in (smallest - 1, smallest)]
    assert share[0] > DELTA / 2 >= share[1]
    with pytest.raises(ValueError, match=rf"max_micro_batch_size=64 is too small.*max_micro_batch_size >= "
                                         rf"{smallest} .*unset"):
        plan_run(n, batch, devices=world, accumulate_grad_batches=k, max_epochs=3, target_epsilon=target,
                 max_micro_batch_size=64)
    run = plan_run(n, batch, devices=world, accumulate_grad_batches=k, max_epochs=3, target_epsilon=target,
                   max_micro_batch_size=smallest)
    assert run.plan.truncation_delta <= DELTA / 2
    # an explicit σ without a target: refused at the ε of the planned steps
    with pytest.raises(ValueError, match="max_micro_batch_size >= "):
        plan_run(n, batch, devices=world, accumulate_grad_batches=k, max_epochs=3, noise_multiplier=1.0,
                 max_micro_batch_size=64)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_a_bad_max_micro_batch_size_is_refused_when_constructed(bad):
    from lightning_dpzero.fabric import DPFabricStrategy

    for strategy in (DPDeepSpeedStrategy, DPFabricStrategy):
        with pytest.raises(ValueError, match="max_micro_batch_size must be an integer >= 1"):
            strategy(max_micro_batch_size=bad)
    assert DPDeepSpeedStrategy(max_micro_batch_size=8).max_micro_batch_size == 8


def test_fixed_size_batches_refuse_a_bound_below_them_and_ignore_one_above():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4)
    q = 4 * 2 / 64
    with pytest.raises(ValueError, match="max_micro_batch_size=3 is below the DataLoader's batch_size=4"):
        private_dataloader(loader, q, 2, 0, poisson=False, max_micro_batch_size=3)
    fixed = private_dataloader(loader, q, 2, 0, poisson=False, max_micro_batch_size=4)
    assert {len(b) for b in fixed.batch_sampler} == {4}
    run = plan_run(64, 4, devices=2, max_epochs=1, noise_multiplier=1.0, poisson_sampling=False,
                   max_micro_batch_size=4)
    assert run.plan.micro_batch_bound is None and run.plan.truncation_delta is None
    with pytest.raises(ValueError, match="below batch_size=4"):
        plan_run(64, 4, devices=2, max_epochs=1, noise_multiplier=1.0, poisson_sampling=False,
                 max_micro_batch_size=3)


# ------------------------------------------------------------------------------------------------ the ledger
@pytest.mark.parametrize("name", ["ledger_without_micro_batch_bound.json",
                                  "sharded_ledger_without_micro_batch_bound.json"])
def test_ledgers_written_before_the_bound_read_and_verify_unchanged(name):
    """Files written by the release before bounded micro-batches: they verify, and write back byte for byte (the
    absent fields are left out of the hash and the JSON)."""
    text = (DATA / name).read_text()
    ledger = PrivacyLedger.from_json(text)
    assert ledger.to_json() == text.rstrip("\n")
    assert all(e.micro_batch_bound is None for e in ledger.entries)
    assert ledger.head == json.loads(text)["head"]


def test_a_bounded_ledger_records_b_and_its_hash_covers_it():
    ledger = PrivacyLedger(DELTA, 100)
    ledger.charge(0.1, 1.0, steps=5, bound=MicroBatchBound(4, 2, (50, 50)))
    ledger.charge(0.1, 1.0, steps=5)  # without the bound: a new entry
    d = ledger.to_dict()
    assert [e.get("max_micro_batch_size") for e in d["entries"]] == [4, None]
    assert d["entries"][0]["accumulate_grad_batches"] == 2 and d["entries"][0]["rank_sizes"] == [50, 50]
    assert PrivacyLedger.from_dict(d) == ledger
    d["entries"][0]["max_micro_batch_size"] = 40
    with pytest.raises(LedgerIntegrityError):
        PrivacyLedger.from_dict(d)
    from lightning_dpzero.accounting.report import ledger_lines

    text = "\n".join(ledger_lines(ledger, "x"))
    assert "micro-batch bound 4 x 2 accumulated" in text and "truncation:" in text


def test_the_accounting_worker_answers_with_the_bound():
    """The background answers (a child process gets the plan and the views as JSON) equal the guard's."""
    from lightning_dpzero.accounting.background import Answerer, ledger_view, plan_tuple
    from lightning_dpzero.accounting import EpsilonTracker

    bound = MicroBatchBound(_binding_cap("pld"), 1, SIZES)
    ledger = PrivacyLedger(DELTA, sum(SIZES))
    ledger.charge(Q, SIGMA, steps=500, bound=bound)
    view = ledger_view(ledger)
    assert view.entries[0].micro_batch_bound == bound
    assert view.after(3, *plan_tuple(Q, SIGMA, "poisson", bound)).entries[0].steps == 503
    answerer = Answerer(EpsilonTracker(), BudgetGuard(1.0), None)
    plan = json.loads(json.dumps(plan_tuple(Q, SIGMA, "poisson", bound)))
    assert answerer.epsilon_after_next_step(view, tuple(plan)) == compute_epsilon(
        [LedgerEntry.of(Q, SIGMA, 501, bound=bound)], DELTA)


# ------------------------------------------------------------------------------------------------ end to end
def _seed_that_binds(n, q, world, k, b, steps, shard_sizes=None):
    """A seed whose unbounded draws exceed K·b on some rank within the first ``steps`` steps (the bounded run must
    then truncate), and that step: (seed, rank, step)."""
    for seed in range(5000):
        for rank, rank_steps in enumerate(_steps(n, q, world, k, None, seed, shard_sizes=shard_sizes, epochs=1)):
            for i, step in enumerate(rank_steps[:steps]):
                if sum(len(mb) for mb in step) > k * b:
                    return seed, rank, i
    raise AssertionError("no seed binds")


@pytest.mark.slow
def test_a_lightning_run_on_two_processes_never_exceeds_the_bound(tmp_path):
    """ZeRO-2, 2 processes, K = 2, b = 7 (14 per rank and step, the expected 8), a seed whose draws exceed it: every
    micro-batch the LightningModule saw holds at most 7 examples, the truncated step holds exactly 14, and the
    ledger records b, K and the ranks' sizes with ε including the truncation."""
    from harness import run_cases

    n, batch, k, b, steps = 64, 4, 2, 7, 4
    q = batch * 2 * k / n
    seed, rank, step = _seed_that_binds(n, q, 2, k, b, steps)
    case = dict(name="bound", model="token", n=n, batch_size=batch, lr=0.1, steps=steps, sigma=3.0, C=1.0,
                clipping="all-layer", clipping_fn="abadi", poisson=True, accumulate=k, stage=2, seed=seed,
                delta=0.5, max_micro_batch_size=b)
    res = run_cases([case], tmp_path, 2)["bound"]
    for seen in res["seen"]:
        assert seen and max(len(idx) for _, idx in seen) <= b
    truncated = [idx for s, idx in res["seen"][rank] if s == step]
    assert sum(len(idx) for idx in truncated) == k * b
    entry = res["ledger"]["entries"][0]
    assert (entry["max_micro_batch_size"], entry["accumulate_grad_batches"], entry["rank_sizes"]) == (b, k, [32, 32])
    ledger = PrivacyLedger.from_dict(res["ledger"])
    assert ledger.epsilon_bound().truncation_delta > 0
    assert res["plan"]["micro_batch_bound"] == MicroBatchBound(b, k, (32, 32))


def test_a_fabric_loop_never_exceeds_the_bound():
    """One process, Fabric: the same with K = 1, b = 14 (the expected 8)."""
    import torch
    from lightning.fabric import Fabric
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dpzero import DPFabricStrategy

    n, batch, b = 64, 8, 14
    seed, _, step = _seed_that_binds(n, batch / n, 1, 1, b, 8)
    strategy = DPFabricStrategy(stage=2, noise_multiplier=5.0, seed=seed, delta=0.5, max_epochs=1,
                                max_micro_batch_size=b)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=batch))
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    assert max(sizes) <= b and sizes[step] == b
    entry = strategy.ledger.entries[0]
    assert entry.micro_batch_bound == MicroBatchBound(b, 1, (n,)) and entry.steps == len(sizes)


def test_calibration_passes_sigmas_at_which_the_truncation_leaves_no_epsilon():
    """At ε = 8 the truncation's (1 + e^ε)·p(T) is large, and at the untruncated σ no ε meets δ (ε = inf there):
    the calibration treats that as too little noise and still meets the target (the docs' worked example)."""
    run = plan_run(60_000, 256, max_epochs=3, target_epsilon=8.0, delta=1e-5, max_micro_batch_size=374)
    plan = run.plan
    ledger = PrivacyLedger(plan.delta, plan.dataset_size)
    ledger.charge(plan.sample_rate, plan.noise_multiplier, steps=plan.planned_steps, bound=plan.micro_batch_bound)
    assert 8.0 * 0.99 <= ledger.epsilon() == run.epsilon_pld <= 8.0
    assert plan.noise_multiplier > plan_run(60_000, 256, max_epochs=3, target_epsilon=8.0).plan.noise_multiplier


def test_runs_with_different_bounds_sum_their_truncation():
    """A resume on another world size opens a new run with its own bound (other rank sizes): p(T) is the sum of
    each run's steps times its own per-step probability, and ε takes it from δ once."""
    from lightning_dpzero.accounting.accountants import truncation_probability

    first, second = MicroBatchBound(4, 2, (50, 50)), MicroBatchBound(4, 2, (25, 25, 25, 25))
    ledger = PrivacyLedger(0.5, 100)
    ledger.charge(0.1, 2.0, steps=3, bound=first)
    ledger.charge(0.1, 2.0, steps=5, bound=second)
    assert len(ledger.entries) == 2
    p = 3 * first.exceed_probability(0.1) + 5 * second.exceed_probability(0.1)
    assert truncation_probability(ledger.entries) == pytest.approx(p, rel=1e-12)
    assert ledger.epsilon_bound().truncation_delta == pytest.approx(truncation_share(ledger.epsilon(), p), rel=1e-9)
