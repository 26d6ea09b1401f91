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


class TinyViT(nn.Module):
    """Conv2d patches → [class token; patches] + position embedding (raw parameters used by the forward) →
    LayerNorm → Linear on the mean of the tokens."""

    def __init__(self, d=6, classes=3):
        super().__init__()
        self.patch = nn.Conv2d(1, d, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.5)
        self.pos_embed = nn.Parameter(torch.randn(1, 5, d) * 0.5)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat((self.cls_token.expand(h.shape[0], -1, -1), h), dim=1) + self.pos_embed
        return self.head(torch.tanh(self.ln(h)).mean(1))


class GainNorm(nn.Module):
    """A user's own normalisation layer (no dedicated rule: the generic rule clips it)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-0.5, 0.5, d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


class GenericNet(nn.Module):
    """Embedding → Linear → GainNorm (generic rule) → Linear on the mean of the tokens."""

    def __init__(self, vocab=13, d=8, classes=3):
        super().__init__()
        self.emb, self.lin = nn.Embedding(vocab, d), nn.Linear(d, d)
        self.norm, self.head = GainNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.lin(self.emb(x)))).mean(1))


class TimeFirstNet(nn.Module):
    """Linear → LayerNorm → Linear applied time-first: (B, T, d) is transposed to (T, B, d) around the stack, as
    a module written for batch_first=False does. With T == B every shape check passes, but each layer's first
    dimension is time: the per-example layout check must refuse it (T = 3 here)."""

    def __init__(self, d=4, classes=3):
        super().__init__()
        self.l1, self.ln, self.l2 = nn.Linear(d, 8), nn.LayerNorm(8), nn.Linear(8, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.l2(torch.tanh(self.ln(self.l1(x.transpose(0, 1)))))
        return self.head(h.transpose(0, 1).mean(1))


def build_model(kind):
    if kind.startswith("zoo:"):  # the HuggingFace models of tests/zoo.py
        import zoo

        return zoo.build(kind[4:])
    return {"token": TokenNet, "conv": ConvNet, "wide": WideNet, "vit": TinyViT, "timefirst": TimeFirstNet,
            "generic": GenericNet}[kind]()


def make_dataset(kind, n):
    if kind.startswith("zoo:"):
        import zoo

        return zoo.make_data(kind[4:], n)
    g = torch.Generator().manual_seed(42)
    if kind in ("token", "generic"):
        x = torch.randint(0, 13, (n, 6), generator=g)
    elif kind == "timefirst":
        x = torch.randn(n, 3, 4, generator=g)
    elif kind in ("conv", "vit"):
        x = torch.randn(n, 1, 8, 8, generator=g)
    else:
        x = torch.randn(n, 128, generator=g)
    return x, torch.randint(0, 3, (n,), generator=g)
