"""A mixture of experts written with ``nn.Linear`` experts, as Mixtral's sparse block was before Hugging Face
grouped its experts into 3-D parameters: each expert runs on the tokens routed to it, gathered by an index
(``hidden[token_idx]``), and its output is added back with ``index_add_`` (``per_sample/token_major.py``,
*Gathered*). Used by the zoo (``zoo.ZOO["mixtral_linear"]``: HF Mixtral with this block in each decoder layer),
the oracle tests (tests/per_sample/test_token_major.py) and the per-layer benchmark (benchmarks/per_layer.py
loads this file: the block it times is the one the tests prove)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

#: how the tokens of an expert are gathered: Mixtral's ``torch.where`` on the one-hot routing mask and
#: ``hidden[token_idx]``, ``index_select``, or a boolean mask of the tokens that chose the expert
Dispatch = Literal["where", "index_select", "mask"]


class Expert(nn.Module):
    """Mixtral's expert MLP: ``w2(silu(w1 x) ⊙ w3 x)`` on rows ``(n, d)``."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(hidden, d, bias=False), \
            nn.Linear(d, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LinearExpertsMoE(nn.Module):
    """Top-k routing over ``experts`` ``nn.Linear`` experts (Mixtral's ``MixtralSparseMoeBlock`` of transformers
    4.x): ``(B, T, d)`` → ``(B, T, d)``. Every expert is called in every forward, on no row if no token chose it
    (on ZeRO-3 every rank then gathers the same experts)."""

    def __init__(self, d: int, hidden: int, experts: int = 4, top_k: int = 2, dispatch: Dispatch = "where"):
        super().__init__()
        self.top_k, self.dispatch = top_k, dispatch
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, hidden) for _ in range(experts))

    def forward(self, hidden):
        b, t, d = hidden.shape
        x = hidden.reshape(-1, d)  # (B·T, d): the tokens as rows
        weights, chosen = self.gate(x).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, len(self.experts)).permute(2, 1, 0)  # (E, k, B·T)
        for e, expert in enumerate(self.experts):
            if self.dispatch == "mask":
                hit = (chosen == e).any(-1)  # (B·T,) bool
                rows = x[hit]
                token = hit.nonzero().squeeze(-1)
                w = (weights * (chosen == e)).sum(-1, keepdim=True)[hit]
            else:
                slot, token = torch.where(mask[e])
                rows = x[token] if self.dispatch == "where" else torch.index_select(x, 0, token)
                w = weights[token, slot, None]
            out.index_add_(0, token, expert(rows) * w)
        return out.view(b, t, d)


def mixtral_linear(vocab: int, d: int, hidden: int, layers: int = 2, experts: int = 4, top_k: int = 2):
    """Hugging Face's Mixtral with :class:`LinearExpertsMoE` in place of each decoder layer's sparse block."""
    import transformers as tf

    model = tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=hidden, num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=32,
        attention_dropout=0.0, attn_implementation="eager"))
    for layer in model.model.layers:
        layer.mlp = LinearExpertsMoE(d, hidden, experts, top_k)
    with torch.no_grad():  # HF initialises the norms to ones: make their gradients non-trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model
