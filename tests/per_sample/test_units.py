"""Privacy units in the per-example engine (``per_sample/units.py``): a unit's gradient is the mean of its rows'
per-example gradients, clipped as one; checked against a float64 per-example loop summed per unit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from lightning_dpzero.per_sample import PerSampleEngine
from lightning_dpzero.per_sample.units import Units
from oracle import backward, clipped_sum, per_example_grads_loop
from test_layers import force_path

V, T, D = 11, 4, 6


class TokenModel(nn.Module):
    """Embedding → LayerNorm → Linear on (B, T, d): every rule row-wise (regrouped unit-first)."""

    def __init__(self, tied=False):
        super().__init__()
        self.emb, self.norm, self.mid = nn.Embedding(V, D), nn.LayerNorm(D), nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.norm(self.emb(ids))))).transpose(1, 2)


class ConvModel(nn.Module):
    """Conv2d (summed by rows) → Linear (regrouped): both ways in one group."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 3, 3), nn.Linear(3 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class RecurrentModel(nn.Module):
    """Embedding → LSTM → MultiheadAttention → Linear: recurrent and attention rules summed by rows."""

    def __init__(self):
        super().__init__()
        self.emb, self.rnn = nn.Embedding(V, D), nn.LSTM(D, D, batch_first=True)
        self.attn, self.fc = nn.MultiheadAttention(D, 2, batch_first=True), nn.Linear(D, 3)

    def forward(self, ids):
        h, _ = self.rnn(self.emb(ids))
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.fc(h.mean(1))


def _data(kind: str, B: int, g: torch.Generator):
    if kind == "conv":
        return torch.randn(B, 1, 6, 6, generator=g), torch.randint(0, 3, (B,), generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    if kind == "rnn":
        return ids, torch.randint(0, 3, (B,), generator=g)
    return ids, torch.randint(0, V, (B, T), generator=g)


MODELS = {"token": TokenModel, "tied": lambda: TokenModel(tied=True), "conv": ConvModel, "rnn": RecurrentModel}


def unit_reference(model, x, y, units: torch.Tensor, C: float, clipping: str, clipping_fn: str = "abadi"):
    """Σ_u clip(mean of unit u's rows' per-example gradients), float64, from a backward per example."""
    per = per_example_grads_loop(model, F.cross_entropy, x, y)
    U = int(units.max()) + 1
    counts = torch.bincount(units, minlength=U).double()
    means = {n: torch.zeros(U, *g.shape[1:], dtype=torch.float64).index_add_(0, units, g)
             / counts.view(-1, *[1] * (g.dim() - 1)) for n, g in per.items()}
    return clipped_sum(model, means, C, clipping, clipping_fn)


def engine_sum(model, x, y, units, C, clipping, clipping_fn="abadi", mode="book-keeping"):
    model.zero_grad(set_to_none=True)
    engine = PerSampleEngine(model, max_grad_norm=C, clipping=clipping, clipping_fn=clipping_fn,
                             clipping_mode=mode).attach()
    try:
        with engine.micro_batch(batch_size=x.shape[0], units=units):
            backward(engine, F.cross_entropy(model(x), y))
    finally:
        engine.detach()
    return engine


# users of 1-3 rows, their rows apart: 0 0 1 2 1 0 3 2 → unit 0 has 3 rows, 1 and 2 two, 3 one
UNITS = torch.tensor([0, 3, 1, 2, 1, 0, 2, 0])


@pytest.mark.parametrize("path", ["ghost", "inst"])
@pytest.mark.parametrize("clipping,clipping_fn,mode", [("all-layer", "abadi", "book-keeping"),
                                                       ("all-layer", "automatic", "two-pass"),
                                                       ("layer-wise", "abadi", "book-keeping")])
@pytest.mark.parametrize("kind", list(MODELS))
def test_unit_gradients_are_the_clipped_means_of_their_rows(kind, clipping, clipping_fn, mode, path):
    torch.manual_seed(0)
    model = MODELS[kind]().train()
    x, y = _data(kind, len(UNITS), torch.Generator().manual_seed(1))
    C = 0.05 if clipping_fn == "abadi" else 1.0
    ref = unit_reference(model, x, y, UNITS, C, clipping, clipping_fn)
    with force_path(path):
        engine = engine_sum(model, x, y, UNITS, C, clipping, clipping_fn, mode)
    assert engine.last_norms.shape == (4,) and engine.stats["examples"] == 4
    if clipping_fn == "abadi":
        assert engine.stats["clipped"] > 0  # C small enough that clipping acts
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=0, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_units_differ_from_clipping_each_row():
    """The guard against a test that cannot fail: per-unit clipping is not per-row clipping."""
    torch.manual_seed(0)
    model = TokenModel().train()
    x, y = _data("token", len(UNITS), torch.Generator().manual_seed(1))
    by_unit = unit_reference(model, x, y, UNITS, 0.05, "all-layer")
    engine_sum(model, x, y, None, 0.05, "all-layer")
    assert max(float((p.grad.double() - by_unit[n]).abs().max()) for n, p in model.named_parameters()) > 1e-3


def test_one_row_per_unit_equals_no_units():
    torch.manual_seed(0)
    model = RecurrentModel().train()
    x, y = _data("rnn", 5, torch.Generator().manual_seed(2))
    engine_sum(model, x, y, None, 0.05, "all-layer")
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine_sum(model, x, y, torch.tensor([4, 2, 0, 1, 3]), 0.05, "all-layer")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], rtol=1e-6, atol=1e-7)


def test_without_clipping_the_sum_is_the_sum_of_unit_means():
    """C = ∞: Σ_u mean of u's rows' gradients (each row weighted 1/n_u) — the plain gradient of that weighted loss."""
    torch.manual_seed(0)
    model = ConvModel().train()
    x, y = _data("conv", len(UNITS), torch.Generator().manual_seed(3))
    engine_sum(model, x, y, UNITS, math.inf, "all-layer")
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    w = 1.0 / torch.bincount(UNITS).float()[UNITS]
    (F.cross_entropy(model(x), y, reduction="none") * w).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("units,match", [(torch.tensor([0, 2, 2]), "0, 1, ..., U-1"),
                                         (torch.tensor([0.0, 1.0, 1.0]), "integer"),
                                         (torch.tensor([0, 1]), "3 examples")])
def test_bad_units_are_refused_naming_the_fix(units, match):
    engine = PerSampleEngine(nn.Linear(2, 2)).attach()
    with pytest.raises(ValueError, match=match):
        engine.start_micro_batch(3, units=units)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=7), st.integers(0, 2**16))
def test_any_unit_map_matches_the_reference(ids, seed):
    units = torch.unique(torch.tensor(ids), return_inverse=True)[1]
    torch.manual_seed(seed)
    model = TokenModel().train()
    x, y = _data("token", len(ids), torch.Generator().manual_seed(seed))
    ref = unit_reference(model, x, y, units, 0.05, "all-layer")
    engine_sum(model, x, y, units, 0.05, "all-layer")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=0, atol=1e-6)


def test_units_regroup_rows_into_their_slots():
    u = Units(torch.tensor([2, 0, 2, 1, 2]))
    assert (u.count, u.n_max) == (3, 3)
    t = torch.arange(5.0).view(5, 1)
    assert u.regroup(t).squeeze(-1).tolist() == [[1, 0, 0], [3, 0, 0], [0, 2, 4]]
    assert torch.allclose(u.sum_rows(t).squeeze(-1), torch.tensor([1.0, 3.0, 2.0]))
