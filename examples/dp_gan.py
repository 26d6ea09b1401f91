"""A differentially private GAN in a Lightning Fabric loop on DeepSpeed ZeRO-3, 2 CPU processes: the
discriminator, the only model that sees the private points, trains with DP-SGD; the generator trains through the
released discriminator on generated points only (post-processing: its steps cost no privacy).

    python examples/dp_gan.py

The private data are 4,096 points of a mixture of four Gaussians at (±2, ±2). The last line printed (rank 0) is
``distance_before=B distance_after=A epsilon=E delta=D``: the mean distance of 2,000 generated points to the
nearest of the four centres, before and after training, and the ε spent (exact, from the privacy ledger).
"""

import os
import warnings

import torch

if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator, without its "unable to detect a GPU" notice
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import logging

import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dpzero  # noqa: F401  (registers the dp_deepspeed* strategies with Fabric too)
from lightning_dpzero import DPFabricStrategy, post_processing

CENTRES = torch.tensor([[2.0, 2.0], [2.0, -2.0], [-2.0, 2.0], [-2.0, -2.0]])
NZ = 8


def distance_to_centres(points: torch.Tensor) -> float:
    return float(torch.cdist(points, CENTRES).min(1).values.mean())


# DeepSpeed's ZeRO collectives call torch.distributed's deprecated names at every step
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor).*")

strategy = DPFabricStrategy(stage=3, max_grad_norm=1.0, target_epsilon=8.0, delta=1e-5, max_epochs=6,
                            clipping="all-layer", logging_level=logging.ERROR)
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
fabric.seed_everything(0)  # the same initial weights and private data on every rank

g = torch.Generator().manual_seed(0)
points = CENTRES[torch.randint(0, 4, (4096,), generator=g)] + 0.3 * torch.randn(4096, 2, generator=g)

discriminator = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2),
                              nn.Linear(64, 1))
generator = nn.Sequential(nn.Linear(NZ, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
before = distance_to_centres(generator(torch.randn(2000, NZ)).detach())
d, opt_d = fabric.setup(discriminator, torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.9)))
# the generator never sees the private points: post-processing of the discriminator's DP steps
gen, opt_g = fabric.setup(post_processing(generator), torch.optim.Adam(generator.parameters(), lr=2e-3,
                                                                       betas=(0.5, 0.9)))
# batch_size is the per-device micro-batch: Poisson sampling at q = 64 x 2 / 4096 per step
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(points), batch_size=64, shuffle=True))
fabric.seed_everything(1 + fabric.global_rank)  # each rank its own generated points

bce = F.binary_cross_entropy_with_logits
for epoch in range(6):
    for (real,) in loader:  # one Poisson-sampled batch per discriminator step
        fake = gen(torch.randn(len(real), NZ))  # one generated point per example of the batch
        # the discriminator: one DP step, clipped per example (its real point and its generated one), noised,
        # charged to the privacy ledger
        d_loss = bce(d(real), torch.ones(len(real), 1)) + bce(d(fake.detach()), torch.zeros(len(real), 1))
        fabric.backward(d_loss, model=d)
        opt_d.step()
        opt_d.zero_grad()
        # the generator: through the released discriminator, on generated points only (no privacy cost)
        fabric.backward(bce(d(fake), torch.ones(len(real), 1)), model=gen)
        opt_g.step()
        opt_g.zero_grad()
        if fabric.strategy.should_stop:  # one more step would exceed target_epsilon
            break
    if fabric.strategy.should_stop:
        break

gen.eval()
with torch.no_grad():
    after = distance_to_centres(gen(torch.randn(2000, NZ)).float())
fabric.print(f"distance_before={before:.2f} distance_after={after:.2f} epsilon={fabric.strategy.epsilon():.2f} "
             f"delta={fabric.strategy.ledger.delta:g}")
