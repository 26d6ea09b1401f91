"""PyTorch's own Transformer modules as users build models from them (``nn.TransformerEncoder``,
``nn.TransformerDecoder``), for the model zoo (``zoo.ZOO``): a causal LM under a float ``-inf`` mask and
``is_causal=True``, a classifier on padded ids (the encoder's nested-tensor path, which PyTorch takes in forwards
without gradients), and an encoder–decoder with a float causal ``tgt_mask``."""

from __future__ import annotations

import torch
from torch import nn

V, T, D, ENC = 32, 8, 16, 5  # as zoo.py's


def _layer(cls=nn.TransformerEncoderLayer):
    return cls(D, 2, 24, dropout=0.0, batch_first=True)


class EncoderLM(nn.Module):
    """ids (B, T) → logits (B, V, T): ``nn.TransformerEncoder`` under
    ``nn.Transformer.generate_square_subsequent_mask`` (0 / -inf) with ``is_causal=True``."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.enc = nn.TransformerEncoder(_layer(), 2, enable_nested_tensor=False)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.enc(self.emb(ids), mask=mask, is_causal=True)).transpose(1, 2)


class PaddedClassifier(nn.Module):
    """ids (B, T) with 0 as padding → logits (B, 3): ``nn.TransformerEncoder`` (nested tensors enabled) given
    ``src_key_padding_mask``, the mean over each example's real tokens, a head."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D, padding_idx=0), nn.Linear(D, 3)
        self.enc = nn.TransformerEncoder(_layer(), 2)

    def forward(self, ids):
        pad = ids == 0
        h = self.enc(self.emb(ids), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


class EncoderDecoder(nn.Module):
    """ids (B, T) → logits (B, V, T - ENC): ``nn.TransformerEncoder`` reads ``ids[:, :ENC]``,
    ``nn.TransformerDecoder`` reads ``ids[:, ENC:]`` under a float causal ``tgt_mask`` and the encoder's memory."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.enc = nn.TransformerEncoder(_layer(), 1, enable_nested_tensor=False)
        self.dec = nn.TransformerDecoder(_layer(nn.TransformerDecoderLayer), 2)

    def forward(self, ids):
        src, tgt = ids[:, :ENC], ids[:, ENC:]
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=ids.device)
        out = self.dec(self.emb(tgt), self.enc(self.emb(src)), tgt_mask=mask, tgt_is_causal=True)
        return self.head(out).transpose(1, 2)


def padded_ids(n: int, g: torch.Generator) -> torch.Tensor:
    """(n, T) ids in [1, V) with a random number (0 to T - 1) of trailing pads (0) per row."""
    x = torch.randint(1, V, (n, T), generator=g)
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    return x.masked_fill(torch.arange(T) >= lengths[:, None], 0)
