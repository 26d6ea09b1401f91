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


class CheckpointedNet(nn.Module):
    """TokenNet with its middle block (Linear → tanh → LayerNorm → Linear) under non-reentrant activation
    checkpointing: the block's forward runs again in every backward pass."""

    def __init__(self, vocab=13, d=8, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.block = nn.Sequential(nn.Linear(d, 12), nn.Tanh(), nn.LayerNorm(12), nn.Linear(12, 12))
        self.head = nn.Linear(12, classes)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(torch.tanh(checkpoint(self.block, self.emb(x), use_reentrant=False)).mean(1))


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


class WideTwoLayers(nn.Module):
    """The wide Linear and a small head: all-layer clipping then spans two layers (the coalesced path)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(128, 256), nn.Linear(256, 3)

    def forward(self, x):
        return self.head(self.fc(x))


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


class RNNLM(nn.Module):
    """Embedding → LSTM (2 layers, packed sequences of the lengths before the padding token 0) → GRU with
    batch_first=False → Linear: next-token logits (B, V, T), one loss per example (the mean over its tokens)."""

    def __init__(self, vocab=13, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, num_layers=2, batch_first=True)
        self.gru = nn.GRU(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        h = self.emb(x)
        if x.shape[0]:  # an empty Poisson batch reaches the forward too; a PackedSequence cannot be empty
            lengths = (x != 0).sum(1).clamp_min(1)
            packed = pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
            h = pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=x.shape[1])[0]
        else:
            h = self.lstm(h)[0]
        h = self.gru(h.transpose(0, 1))[0].transpose(0, 1)
        return self.head(h).transpose(1, 2)


class BagNet(nn.Module):
    """EmbeddingBag (mean, padding_idx=0) on 1-D indices with offsets built from (B, N) rows → Linear."""

    def __init__(self, vocab=13, d=6, classes=3):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, d, mode="mean", padding_idx=0)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        lengths = (x != 0).sum(1)
        keep = torch.arange(x.shape[1]) < lengths.unsqueeze(1)
        offsets = torch.cumsum(lengths, 0) - lengths
        return self.head(torch.tanh(self.bag(x[keep], offsets)))


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
    if kind.startswith(("zoo:", "zoo_lora:")):  # the HuggingFace models of tests/zoo.py, with LoRA adapters or not
        import zoo

        family = kind.split(":", 1)[1]
        return zoo.with_lora(zoo.build(family), family) if kind.startswith("zoo_lora:") else zoo.build(family)
    return {"token": TokenNet, "ckpt": CheckpointedNet, "conv": ConvNet, "wide": WideNet, "wide2": WideTwoLayers,
            "vit": TinyViT, "rnn": RNNLM, "bag": BagNet, "timefirst": TimeFirstNet, "generic": GenericNet}[kind]()


#: models the harness checks with a backward per example (loop) instead of torch.func (vmap cannot batch them)
LOOP_ORACLE = {"rnn", "bag", "ckpt"}


def make_dataset(kind, n):
    if kind.startswith(("zoo:", "zoo_lora:")):
        import zoo

        return zoo.make_data(kind.split(":", 1)[1], n)
    g = torch.Generator().manual_seed(42)
    if kind in ("rnn", "bag"):  # sequences of 1..6 tokens (1..12), padded with token 0
        x = torch.randint(1, 13, (n, 6), generator=g)
        x[torch.arange(6) >= torch.randint(1, 7, (n, 1), generator=g)] = 0
        if kind == "rnn":
            return x, torch.randint(0, 13, (n, 6), generator=g)
    elif kind in ("token", "generic", "ckpt"):
        x = torch.randint(0, 13, (n, 6), generator=g)
    elif kind == "timefirst":
        x = torch.randn(n, 3, 4, generator=g)
    elif kind in ("conv", "vit"):
        x = torch.randn(n, 1, 8, 8, generator=g)
    else:
        x = torch.randn(n, 128, generator=g)
    return x, torch.randint(0, 3, (n,), generator=g)
