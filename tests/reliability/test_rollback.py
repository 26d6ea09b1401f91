"""Rollbacks: two lineages from one checkpoint never share noise (docs/reliability.md, *Rollbacks*)."""

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpzero import DPDeepSpeedStrategy, DPFabricStrategy, PrivacyAccountantCallback
from test_security import NoiseOnly, _params


def _no_repeats(earlier, later):
    return not [(i, j) for i, a in enumerate(later) for j, b in enumerate(earlier) if torch.equal(a, b)]


def _corr(a, b):
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


@pytest.mark.parametrize("seed", [None, 5])
def test_a_trainer_rolled_back_to_a_checkpoint_draws_noise_no_earlier_fit_drew(tmp_path, noise_draws, seed):
    """One Trainer: fit 2 steps and save; fit on to step 4; fit again from the step-2 checkpoint. Steps 3-4 of the
    second lineage must not repeat the first's noise (their difference would cancel it exactly)."""
    draws = noise_draws
    L.seed_everything(0, verbose=False)
    model = NoiseOnly()
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0, seed=seed)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[PrivacyAccountantCallback()])
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "ckpt")
    p2, n2 = _params(model), len(draws)
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(model)
    p4a, n4 = _params(model), len(draws)
    trainer.fit(model, ckpt_path=tmp_path / "ckpt")
    p4b = _params(model)
    assert strategy.ledger.steps == trainer.global_step == 4 and len(draws) - n4 == n4 - n2 > 0
    assert _no_repeats(draws[:n4], draws[n4:])
    corr = _corr(p4a - p2, p4b - p2)
    assert abs(corr) < 0.5, f"the two lineages' steps 3-4 share noise: correlation {corr:.4f}"


def test_fabric_rolled_back_twice_to_one_checkpoint_draws_fresh_noise_each_time(tmp_path, noise_draws):
    """Fabric: train 2 steps and save; 2 more; load the checkpoint and train 2; load it again and train 2. Each
    load continues the checkpoint's ledger (no refusal) with noise no earlier steps drew."""
    draws = noise_draws
    fabric = Fabric(accelerator="cpu", devices=1, strategy=DPFabricStrategy(stage=2, noise_multiplier=1.0))
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8))
    state = {"model": model, "optimizer": optimizer}

    def train(steps):
        before, n = torch.cat([p.detach().flatten() for p in net.parameters()]), len(draws)
        for _, (x, _y) in zip(range(steps), loader):
            fabric.backward((model(x) * 0.0).sum())  # noise-only updates
            optimizer.step()
            optimizer.zero_grad()
        return torch.cat([p.detach().flatten() for p in net.parameters()]) - before, draws[n:]

    train(2)
    fabric.save(tmp_path / "ckpt", state)
    lineages = [train(2)]
    for _ in range(2):
        fabric.load(tmp_path / "ckpt", state)
        assert fabric.strategy.ledger.steps == 2
        lineages.append(train(2))
        assert fabric.strategy.ledger.steps == 4
    for i, (update, drawn) in enumerate(lineages):
        for other, other_drawn in lineages[:i]:
            assert _no_repeats(other_drawn, drawn)
            assert not torch.allclose(update, other)
