"""A tiny LightningModule that counts its training micro-batches, on a 32-example dataset: shared by tests in
different folders (tests/lightning/test_budget.py, tests/sampling/test_sampling.py)."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N = 32


def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 4, generator=g), torch.randint(0, 2, (N,), generator=g))


class Net(L.LightningModule):
    def __init__(self, batch_size=2, loader_kw=None):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.batch_size, self.loader_kw = batch_size, loader_kw or {}
        self.micro_batches = 0

    def training_step(self, batch, _):
        if torch.is_grad_enabled():  # not the strategy's layout check, which re-runs it without gradients
            self.micro_batches += 1
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        kw = dict(self.loader_kw)
        if "batch_sampler" not in kw:
            kw["batch_size"] = self.batch_size
        return DataLoader(dataset(), **kw)
