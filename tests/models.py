"""Small models covering every supported layer, and their data, shared by workers and oracles."""

import torch
from torch import nn


class TokenNet(nn.Module):
    """Embedding (with padding_idx) → Linear on (B, T, d) → LayerNorm → Linear on (B, d)."""

    def __init__(self, vocab=13, d=8, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.lin = nn.Linear(d, 12)
        self.ln = nn.LayerNorm(12)
        self.head = nn.Linear(12, classes)

    def forward(self, x):
        return self.head(self.ln(torch.tanh(self.lin(self.emb(x)))).mean(1))


class ConvNet(nn.Module):
    """Conv2d → GroupNorm → Linear."""

    def __init__(self, classes=3):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 4 * 4, classes)

    def forward(self, x):
        return self.fc(torch.relu(self.gn(self.conv(x))).flatten(1))


class WideNet(nn.Module):
    """One wide Linear: many coordinates for the statistical noise test."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(128, 256)

    def forward(self, x):
        return self.fc(x)


def build_model(kind):
    return {"token": TokenNet, "conv": ConvNet, "wide": WideNet}[kind]()


def make_dataset(kind, n):
    g = torch.Generator().manual_seed(42)
    if kind == "token":
        x = torch.randint(0, 13, (n, 6), generator=g)
    elif kind == "conv":
        x = torch.randn(n, 1, 8, 8, generator=g)
    else:
        x = torch.randn(n, 128, generator=g)
    return x, torch.randint(0, 3, (n,), generator=g)
