"""check_per_example: the batched per-example norms against a backward per example."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpzero.per_sample import PerExampleMismatchError, check_per_example
from models import TinyViT, TokenNet


@pytest.mark.parametrize("build, x", [
    (TinyViT, lambda: torch.randn(5, 1, 8, 8)),
    (TokenNet, lambda: torch.randint(0, 13, (5, 6))),
])
def test_independent_models_pass(build, x):
    torch.manual_seed(0)
    model = build()
    norms = check_per_example(model, x(), torch.randint(0, 3, (5,)), F.cross_entropy)
    assert norms.shape == (5,) and (norms > 0).all()
    assert all(p.grad is None for p in model.parameters())  # the model itself is untouched


class Centred(nn.Module):
    """Batch centring: every example's activation depends on the whole batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return self.head(self.drop(h - h.mean(0, keepdim=True)))


def test_batch_mixing_is_caught():
    torch.manual_seed(1)
    with pytest.raises(PerExampleMismatchError, match="mixes examples"):
        check_per_example(Centred(), torch.randn(4, 4), torch.randint(0, 3, (4,)), F.cross_entropy)


def test_in_batch_contrastive_loss_is_caught():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))

    def contrastive(z, _):  # each example's logits are its similarities to every example of the batch
        z = F.normalize(z, dim=1)
        return F.cross_entropy(z @ z.T / 0.1, torch.arange(z.shape[0]))

    with pytest.raises(PerExampleMismatchError):
        check_per_example(model, torch.randn(4, 4), torch.zeros(4), contrastive)
