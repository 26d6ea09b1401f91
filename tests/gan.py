"""A small DP-GAN in a Fabric loop, shared by its tests (one process in the test, two through ``gan_worker.py``):
the discriminator private (DP-SGD), the generator post-processing of it (docs/how-to/dp-gan.md); and the replay of
its updates from float64 per-example gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from oracle import clipped_sum

NZ, DIM = 4, 6


def generator() -> nn.Module:
    return nn.Sequential(nn.Linear(NZ, 8), nn.Tanh(), nn.Linear(8, DIM))


def discriminator() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))


class Real(Dataset):
    """The private data: points of a shifted Gaussian, each with its index."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(42)
        self.x = torch.randn(n, DIM, generator=g) * 0.5 + 1.0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], torch.tensor(i)


def d_loss(d, real, fake):
    """Each example's loss on its real point and on the generated point paired with it (mean over the batch)."""
    ones, zeros = torch.ones(len(real)), torch.zeros(len(fake))
    return (F.binary_cross_entropy_with_logits(d(real).squeeze(-1), ones)
            + F.binary_cross_entropy_with_logits(d(fake).squeeze(-1), zeros))


def g_loss(d, fake):
    return F.binary_cross_entropy_with_logits(d(fake).squeeze(-1), torch.ones(len(fake)))


def train(fabric, d, opt_d, g, opt_g, loader, steps):
    """The loop as the docs write it; returns what each step saw: (step, indices or [] for an empty batch's
    stand-in, the noise z)."""
    seen = []
    while len(seen) < steps:
        for real, idx in loader:
            z = torch.randn(len(real), NZ)  # one generated point per example of the batch
            seen.append((len(seen), [] if fabric.strategy.stand_in_batch else idx.tolist(), z))
            fake = g(z)
            # the discriminator: one DP step on the batch (the ledger charges it)
            fabric.backward(d_loss(d, real, fake.detach()), model=d)
            opt_d.step()
            opt_d.zero_grad()
            # the generator: through the released discriminator, on generated points only (post-processing)
            fabric.backward(g_loss(d, fake), model=g)
            opt_g.step()
            opt_g.zero_grad()
            if len(seen) == steps:
                break
    return seen


def replay(case, init_d, init_g, seen_by_rank, expected_batch_size):
    """The run's updates rebuilt in float64: per step, Σ_i clip(∇ℓ_i) / B_exp for the discriminator (ℓ_i on example
    i's real point and its generated one, every rank's examples), then the generator's gradient through the updated
    discriminator, averaged over the ranks. Returns the final parameters of both."""
    d, g = discriminator().double(), generator().double()
    d.load_state_dict(init_d)
    g.load_state_dict(init_g)
    data = Real(case["n"]).x.double()
    for step in range(case["steps"]):
        rows = [(idx, z.double()) for seen in seen_by_rank for s, idx, z in seen if s == step]
        with torch.no_grad():
            fakes = [(idx, g(z)) for idx, z in rows]
        pairs = [(data[i], f[k]) for idx, f in fakes for k, i in enumerate(idx)]
        if pairs:
            names = [n for n, _ in d.named_parameters()]
            per = {n: [] for n in names}
            for real, fake in pairs:
                grads = torch.autograd.grad(d_loss(d, real[None], fake[None]), list(d.parameters()))
                for n, gr in zip(names, grads):
                    per[n].append(gr)
            summed = clipped_sum(d, {n: torch.stack(v) for n, v in per.items()}, case["C"], case["clipping"])
            with torch.no_grad():
                for n, p in d.named_parameters():
                    p -= case["lr"] * summed[n] / expected_batch_size
        grads = [torch.autograd.grad(g_loss(d, g(z)), list(g.parameters())) for _, z in rows]
        with torch.no_grad():
            for k, p in enumerate(g.parameters()):
                p -= case["lr"] * sum(gr[k] for gr in grads) / len(grads)
    return d.state_dict(), g.state_dict()


def run(case, devices: int):
    """Fabric, the models, the loop: returns (fabric, strategy, records)."""
    from lightning.fabric import Fabric

    from lightning_dpzero import DPFabricStrategy, post_processing

    strategy = DPFabricStrategy(stage=case["stage"], noise_multiplier=case.get("sigma", 0.0), max_grad_norm=case["C"],
                                clipping=case["clipping"], seed=case.get("seed", 1234), max_steps=case["steps"],
                                accounting_worker="none")
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    torch.manual_seed(case.get("init_seed", 0))
    d, g = discriminator(), generator()
    init_d = {k: v.clone() for k, v in d.state_dict().items()}
    init_g = {k: v.clone() for k, v in g.state_dict().items()}
    opt_d, opt_g = torch.optim.SGD(d.parameters(), lr=case["lr"]), torch.optim.SGD(g.parameters(), lr=case["lr"])
    d_raw, g_raw = d, g
    d, opt_d = fabric.setup(d, opt_d)
    g, opt_g = fabric.setup(post_processing(g), opt_g)
    loader = fabric.setup_dataloaders(DataLoader(Real(case["n"]), batch_size=case["batch_size"]))
    torch.manual_seed(1000 + fabric.global_rank)  # each rank's own generated points
    seen = train(fabric, d, opt_d, g, opt_g, loader, case["steps"])
    return fabric, strategy, dict(init_d=init_d, init_g=init_g, seen=seen, d=d_raw, g=g_raw)


def gathered(module, stage):
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
