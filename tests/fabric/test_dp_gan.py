"""A DP-GAN in a Fabric loop (docs/how-to/dp-gan.md): the discriminator private (each step clipped, noised and
charged once with its own Poisson-sampled batch), the generator a post-processing model with its own optimizer
(``post_processing``; not charged). Both match a float64 replay, in one process and on ZeRO-3 with two; what the
post-processing argument needs is enforced before any update that would break it."""

from __future__ import annotations

import pytest
import torch

import gan
from harness import run_cases

BASE = dict(n=40, batch_size=4, lr=0.5, steps=4, C=0.2, clipping="all-layer", stage=3)


def _check(case, init, final, seen_by_rank, plan, ledger, steps):
    assert steps == case["steps"] and sum(e["steps"] for e in ledger["entries"]) == case["steps"]  # D's steps only
    want_d, want_g = gan.replay(case, init["d"], init["g"], seen_by_rank, plan["expected_batch_size"])
    for part, want in (("d", want_d), ("g", want_g)):
        moved = max(float((final[part][k] - init[part][k]).abs().max()) for k in want)
        assert moved > 1e-3, (case, part)
        for k, v in want.items():
            torch.testing.assert_close(final[part][k].double(), v, rtol=0, atol=1e-5, msg=lambda m: f"{part}.{k}: {m}")


@pytest.mark.parametrize("clipping", ["all-layer", "layer-wise"])
def test_a_dp_gan_matches_the_replay_in_one_process(clipping):
    case = dict(BASE, clipping=clipping)
    fabric, strategy, rec = gan.run(case, 1)
    try:
        final = {"d": gan.gathered(rec["d"], 3), "g": gan.gathered(rec["g"], 3)}
        _check(case, {"d": rec["init_d"], "g": rec["init_g"]}, final, [rec["seen"]], vars(strategy.plan),
               strategy.ledger.to_dict(), strategy.steps.taken)
    finally:
        strategy.teardown()


@pytest.mark.slow
def test_a_dp_gan_on_zero3_with_two_processes_matches_the_replay(tmp_path):
    """Poisson batches of one expected example per rank: some are empty, and their step trains the generator on
    the stand-in's generated point while the discriminator's step adds nothing of it."""
    cases = [dict(BASE, name="gan_al"), dict(BASE, name="gan_lw_small", clipping="layer-wise", batch_size=1, steps=6)]
    results = run_cases(cases, tmp_path, world_size=2, timeout=900, worker="gan_worker.py")
    for case in cases:
        res = results[case["name"]]
        seen = [[(s, idx, torch.tensor(z)) for s, idx, z in rank] for rank in res["seen"]]
        if case["batch_size"] == 1:
            assert any(not idx for rank in seen for _, idx, _ in rank)
        _check(case, res["init"], res["final"], seen, res["plan"], res["ledger"], res["steps"])
        for r in (1,):  # every rank holds the same models
            for part in ("d", "g"):
                for k, v in res["final"][part].items():
                    torch.testing.assert_close(res["final_rank"][r][part][k], v, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ refused before the update
def _gan(stage=2):
    """Fabric (one process), the discriminator set up privately, the generator as post-processing, the loader."""
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from lightning_dpzero import DPFabricStrategy, post_processing

    strategy = DPFabricStrategy(stage=stage, noise_multiplier=1.0, max_steps=4, accounting_worker="none")
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    d, g = gan.discriminator(), gan.generator()
    d, opt_d = fabric.setup(d, torch.optim.SGD(d.parameters(), lr=0.1))
    g, opt_g = fabric.setup(post_processing(g), torch.optim.SGD(g.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(gan.Real(40), batch_size=4))
    return fabric, d, opt_d, g, opt_g, loader


def _state(*models):
    return [p.detach().clone() for m in models for p in m.parameters()]


@pytest.mark.parametrize("mistake", ["fake_not_detached", "generator_loss_on_real", "generator_step_first",
                                     "second_forward_on_the_batch"])
def test_what_post_processing_needs_is_enforced_before_any_update(mistake):
    fabric, d, opt_d, g, opt_g, loader = _gan()
    real, _ = next(iter(loader))
    z = torch.randn(len(real), gan.NZ)
    fake = g(z)
    before = _state(d, g)
    with pytest.raises(Exception) as err:
        if mistake == "generator_step_first":  # the generator's loss through a forward between the draw and D's step
            fabric.backward(gan.g_loss(d, fake), model=g)
        if mistake == "second_forward_on_the_batch":
            fabric.backward(gan.d_loss(d, real, real * 0.5), model=d)
        fabric.backward(gan.d_loss(d, real, fake if mistake == "fake_not_detached" else fake.detach()), model=d)
        opt_d.step()
        opt_d.zero_grad()
        if mistake == "generator_loss_on_real":  # e.g. feature matching against the batch: reads private examples
            loss = gan.g_loss(d, fake) + (d(real).mean() - d(fake).mean()) ** 2
        else:
            loss = gan.g_loss(d, fake)
        fabric.backward(loss, model=g)
        opt_g.step()
    message = str(err.value)
    expected = {"fake_not_detached": "fake.detach()", "generator_loss_on_real": "tensor of the batch drawn",
                "generator_step_first": "after the private step", "second_forward_on_the_batch": "second training forward"}
    assert expected[mistake] in message, message
    after = _state(d, g)
    d_steps = fabric.strategy.ledger.steps
    if mistake == "generator_loss_on_real":  # refused after D's (valid, charged) step: the generator did not move
        assert d_steps == 1 and all(torch.equal(a, b) for a, b in zip(before[-4:], after[-4:]))
    else:
        assert d_steps == 0 and all(torch.equal(a, b) for a, b in zip(before, after))
    fabric.strategy.teardown()


def test_the_generator_is_not_charged_and_the_discriminator_is_frozen_only_while_it_trains():
    """After each private step, until the next draw (or the strategy's teardown), the discriminator is frozen."""
    fabric, d, opt_d, g, opt_g, loader = _gan()
    for step, (real, _) in zip(range(3), loader):
        fake = g(torch.randn(len(real), gan.NZ))
        fabric.backward(gan.d_loss(d, real, fake.detach()), model=d)
        opt_d.step()
        opt_d.zero_grad()
        assert not any(p.requires_grad for p in d.parameters())  # the public phase: a generator's backward
        fabric.backward(gan.g_loss(d, fake), model=g)              # gives the discriminator nothing
        assert all(p.grad is None for p in d.parameters())
        opt_g.step()
        opt_g.zero_grad()
    assert fabric.strategy.ledger.steps == 3  # the discriminator's steps; the generator's are post-processing
    real, _ = next(iter(loader))
    assert all(p.requires_grad for p in d.parameters())  # the next draw: trainable again
    fabric.backward(gan.d_loss(d, real, g(torch.randn(len(real), gan.NZ)).detach()), model=d)
    opt_d.step()
    assert not any(p.requires_grad for p in d.parameters())  # after the last step, until the next draw
    fabric.strategy.teardown()
    assert all(p.requires_grad for p in d.parameters())  # the end of the run: as the user set them


def test_a_second_private_model_is_refused_with_the_post_processing_fix():
    from lightning.fabric import Fabric

    from lightning_dpzero import DPFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=1, strategy=DPFabricStrategy(stage=2, noise_multiplier=1.0))
    fabric.launch()
    d, g = gan.discriminator(), gan.generator()
    fabric.setup(d, torch.optim.SGD(d.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"second model under DP.*post_processing\(generator\)"):
        fabric.setup(g, torch.optim.SGD(g.parameters(), lr=0.1))
    fabric.strategy.teardown()
