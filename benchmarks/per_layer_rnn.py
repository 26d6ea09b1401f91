"""The RNN and EmbeddingBag rows of ``benchmarks/per_layer.py``: the layers as one-tensor-in, one-tensor-out
modules (so every method's loss is ``Σ out ⊙ R``), and Opacus 1.6 as its users run these layers."""

from __future__ import annotations

import torch
from torch import nn


class FirstOutput(nn.Module):
    """An RNN returning only its output (B, T, D·H), so every method's loss is ``Σ out ⊙ R``."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0]


class Bags(nn.Module):
    """An EmbeddingBag on (B, N) rows given as 1-D indices with offsets (one bag per row)."""

    def __init__(self, bag: nn.EmbeddingBag):
        super().__init__()
        self.bag = bag

    def forward(self, x):
        return self.bag(x.reshape(-1), torch.arange(0, x.numel(), x.shape[1], device=x.device))


def m_opacus(layer, x, R, clip_sum):
    """Opacus 1.6 as its users run these layers: ``nn.LSTM``/``nn.GRU`` swapped for ``DPLSTM``/``DPGRU`` (the
    same weights), per-example gradients from ``GradSampleModule``'s hooks, then clipping and the sum.
    ``clip_sum``: per-parameter per-example gradients -> their clipped sum (``per_layer.py``'s, the same
    clipping as every other method; passed in so that this module does not import ``per_layer.py``)."""
    from opacus.grad_sample import GradSampleModule
    from opacus.layers import DPGRU, DPLSTM

    if isinstance(layer, FirstOutput):
        rnn = layer.rnn
        dp = {nn.LSTM: DPLSTM, nn.GRU: DPGRU}[type(rnn)](rnn.input_size, rnn.hidden_size, num_layers=rnn.num_layers,
                                                         bidirectional=rnn.bidirectional, batch_first=True)
        dp.load_state_dict(rnn.state_dict())
        layer = FirstOutput(dp)
    gsm = GradSampleModule(layer, loss_reduction="mean")
    names = [n for n, _ in layer.named_parameters()]
    float_in = x.is_floating_point()

    def step():
        gsm.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(float_in)
        ((gsm(xi) * R).sum() / x.shape[0]).backward()
        per = {n: p.grad_sample for n, p in zip(names, layer.parameters())}
        return clip_sum(per), (xi.grad if float_in else None)

    return step
