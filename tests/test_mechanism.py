"""DPMechanism without Lightning or DeepSpeed: the DP step driven from a plain PyTorch loop, as a Fabric loop or the
audit drives it, checked against the torch.func oracle (docs/design.md, *The mechanism*; I2, I3, I4)."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from oracle import clipped_sum, per_example_grads
from lightning_dpzero import PerSampleEngine, PrivacyLedger
from lightning_dpzero.mechanism import DPMechanism, NonFiniteLossError
from lightning_dpzero.accounting.plan import PrivacyPlan

B_EXP, C = 8.0, 0.5


def _mechanism(model, sigma, seed=0, b_exp=B_EXP, c=C):
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    mechanism = DPMechanism(noise_multiplier=sigma, max_grad_norm=c, seed=seed)
    mechanism.attach(PerSampleEngine(model, max_grad_norm=c, clipping="all-layer").attach())
    mechanism.install_noise(optimizer, replicated=True)
    mechanism.use_plan(PrivacyPlan(dataset_size=100, sample_rate=b_exp / 100, expected_batch_size=b_exp,
                                   noise_multiplier=sigma, delta=1e-5, planned_steps=None, sampler_kind="poisson"))
    return mechanism, optimizer


def _step(mechanism, optimizer, micro_batches, model, loss_fn=F.cross_entropy, charged_before=None):
    """One optimizer step over K micro-batches, each loss divided by K as Lightning's loop does."""
    k = len(micro_batches)

    def closure():
        for x, y in micro_batches:
            loss = mechanism.training_step(lambda: loss_fn(model(x), y), len(x))
            mechanism.probe_loss(loss / k, accumulate_grad_batches=k).backward()

    def step(charged_closure):
        charged_closure()
        if charged_before is not None:
            charged_before.append(mechanism.ledger.steps)  # what the ledger holds when the update is applied
        optimizer.step()

    optimizer.zero_grad(set_to_none=True)
    mechanism.optimizer_step(step, closure, boundary=True, step_applied=lambda: True)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


@pytest.mark.parametrize("k", [1, 2])
def test_sigma_zero_step_is_the_clipped_sum_over_the_expected_batch(k):
    """I2 and the divisor: the update is -lr · Σ_i clip(g_i) / B_exp over the union of the K micro-batches."""
    model, c = _net(), 1.5  # norms 1.3-1.8: some examples are clipped, some not
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 6, generator=g), torch.randint(0, 3, (7,), generator=g)
    expected = clipped_sum(model, per_example_grads(model, F.cross_entropy, x, y), c)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mechanism, optimizer = _mechanism(model, sigma=0.0, c=c)
    micro = [(x[:4], y[:4]), (x[4:], y[4:])] if k == 2 else [(x, y)]
    _step(mechanism, optimizer, micro, model)
    for n, p in model.named_parameters():
        torch.testing.assert_close((before[n] - p.detach()).double(), expected[n] / B_EXP, rtol=1e-5, atol=1e-6)
    stats = mechanism.take_stats()
    assert stats.examples == 7 and 0 < stats.clipped < 7 and stats.norm_sum > 0
    assert mechanism.take_stats().examples == 0  # taken means reset


def test_noise_std_is_sigma_c_over_the_expected_batch():
    """I3: an empty step releases noise alone, N(0, (σC/B_exp)²) per coordinate."""
    torch.manual_seed(0)
    model = nn.Linear(200, 100)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    mechanism, optimizer = _mechanism(model, sigma=2.0)
    _step(mechanism, optimizer, [], model)  # no micro-batch at all: every gradient is None, then noise
    released = before - torch.cat([p.detach().flatten() for p in model.parameters()])
    assert released.numel() == 20100
    assert released.std().item() == pytest.approx(2.0 * C / B_EXP, rel=0.03)
    assert abs(released.mean().item()) < 4 * 2.0 * C / B_EXP / math.sqrt(released.numel())


def test_the_ledger_is_charged_before_the_update_and_only_at_a_boundary():
    model = _net()
    mechanism, optimizer = _mechanism(model, sigma=1.0)
    seen = []
    _step(mechanism, optimizer, [(torch.randn(4, 6), torch.randint(0, 3, (4,)))], model, charged_before=seen)
    assert seen == [1] and mechanism.ledger.steps == 1
    mechanism.optimizer_step(lambda c: c(), lambda: None, boundary=False, step_applied=lambda: False)
    assert mechanism.ledger.steps == 1  # a micro-batch inside an accumulation: no step released, no charge
    entry = mechanism.ledger.entries[0]
    assert (entry.sample_rate, entry.noise_multiplier, entry.sampler) == (B_EXP / 100, 1.0, "poisson")


def test_an_update_applied_without_the_noise_hook_stops_training():
    model = _net()
    mechanism, _ = _mechanism(model, sigma=1.0)
    with pytest.raises(RuntimeError, match="without the DP noise hook"):
        mechanism.optimizer_step(lambda c: c(), lambda: None, boundary=True, step_applied=lambda: True)


def test_a_non_finite_loss_stops_with_the_step_charged_and_nothing_applied():
    model = _net()
    before = [p.detach().clone() for p in model.parameters()]
    mechanism, optimizer = _mechanism(model, sigma=1.0)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    with pytest.raises(NonFiniteLossError, match=r"optimizer step None.*charged to the privacy ledger \(1 steps"):
        _step(mechanism, optimizer, [(x, y)], model, loss_fn=lambda out, t: F.cross_entropy(out, t) * math.inf)
    assert mechanism.ledger.steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_an_empty_micro_batch_has_a_zero_loss_and_silenced_logging():
    model = _net()
    mechanism, _ = _mechanism(model, sigma=1.0)

    class Module:
        logged = []

        def log(self, *args, **kwargs):
            self.logged.append(args)

        log_dict = log

    module = Module()

    def run():
        module.log("loss", 1.0)
        return F.cross_entropy(model(torch.zeros(0, 6)), torch.zeros(0, dtype=torch.long))  # NaN over 0 examples

    loss = mechanism.training_step(run, 0, module=module)
    assert loss.item() == 0.0 and module.logged == [] and "log" not in vars(module)


def test_resume_continues_the_ledger_with_fresh_deterministic_streams():
    ledger = PrivacyLedger(delta=1e-5, dataset_size=100)
    ledger.charge(B_EXP / 100, 1.0, steps=3)

    def released(resume):
        model = _net()
        mechanism, optimizer = _mechanism(model, sigma=1.0, seed=7)
        if resume:
            restored = PrivacyLedger.from_dict(ledger.to_dict())  # as loaded from the checkpoint, on each rank
            mechanism.resume(restored)
            mechanism.use_plan(mechanism.plan)  # the plan opens the ledger: the checkpoint's
            assert mechanism.ledger is restored
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        _step(mechanism, optimizer, [], model)
        return mechanism.seed, before - torch.cat([p.detach().flatten() for p in model.parameters()])

    (seed0, first), (seed1, resumed), (seed2, resumed_again) = released(False), released(True), released(True)
    assert seed0 == 7 and seed1 == seed2 != 7  # derived from the seed and the ledger's position: alike on all ranks
    assert torch.equal(resumed, resumed_again)
    assert not torch.equal(first, resumed)  # the resumed run does not replay the run's first noise draw


def test_two_different_ledgers_for_one_resume_are_refused():
    a, b = PrivacyLedger(1e-5, 100), PrivacyLedger(1e-5, 100)
    mechanism = DPMechanism(1.0, C)
    mechanism.restore_ledger(a)
    mechanism.restore_ledger(PrivacyLedger.from_dict(a.to_dict()))  # an equal copy is fine
    with pytest.raises(ValueError, match="disagree"):
        mechanism.restore_ledger(b)


def test_a_restored_ledger_for_other_data_is_refused():
    model = _net()
    mechanism = DPMechanism(1.0, C)
    mechanism.attach(PerSampleEngine(model, max_grad_norm=C).attach())
    mechanism.restore_ledger(PrivacyLedger(1e-5, 50))
    with pytest.raises(ValueError, match=r"N=50.*N=100.*same data"):
        mechanism.use_plan(PrivacyPlan(dataset_size=100, sample_rate=0.08, expected_batch_size=8.0,
                                       noise_multiplier=1.0, delta=1e-5, planned_steps=None,
                                       sampler_kind="poisson"))


@pytest.mark.parametrize("sigma, c, match", [(-1.0, 1.0, "noise_multiplier"), (math.nan, 1.0, "noise_multiplier"),
                                             (1.0, math.inf, "infinite noise")])
def test_bad_sigma_is_refused(sigma, c, match):
    with pytest.raises(ValueError, match=match):
        DPMechanism(sigma, c)


def test_the_noised_optimizer_updates_only_inside_a_charged_step_and_once():
    """#40.7: a step of the noised optimizer that no ledger entry covers (outside optimizer_step), or a second
    update of the same parameters under one charge, is refused before the parameters change."""
    model = _net()
    mechanism, optimizer = _mechanism(model, sigma=1.0)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    loss = mechanism.training_step(lambda: F.cross_entropy(model(x), y), len(x))
    mechanism.probe_loss(loss).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="stepped outside the DP strategy's optimizer step"):
        optimizer.step()
    assert mechanism.ledger.steps == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    def twice(charged_closure):
        charged_closure()
        optimizer.step()
        after_one.extend(p.detach().clone() for p in model.parameters())
        optimizer.step()

    after_one = []
    with pytest.raises(RuntimeError, match="stepped twice within one charged optimizer step"):
        mechanism.optimizer_step(twice, lambda: None, boundary=True, step_applied=lambda: True)
    assert mechanism.ledger.steps == 1 and all(torch.equal(a, b) for a, b in zip(after_one, model.parameters()))
    _step(mechanism, optimizer, [(x, y)], model)  # the next charged step works as before
    assert mechanism.ledger.steps == 2
