"""``nn.RNN``/``nn.GRU``/``nn.LSTM`` (docs/design.md, *The per-example engine*; I2 for one layer): the engine's
Σ_i clip(g_i) against a float64 backward per example of PyTorch's own module run on that example alone, over
random configurations (hypothesis): cell, layers, directions, ``batch_first``, bias, ``proj_size``, padded or
packed (sorted or not) sequences, an initial state computed by the model or not, B = 0..3, each clipping style
and function and path. Inter-layer dropout is checked against PyTorch's own forward with the same seed (its
masks), the outputs against PyTorch's to float32 rounding, and the refusals.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from lightning_dpzero.per_sample import PerSampleEngine, UnsupportedLayerError
from oracle import check_engine_against_loop
from test_layers import EXAMPLES, clip_st, force_path

pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")

CELLS = {"lstm": (nn.LSTM, {}), "lstm_proj": (nn.LSTM, {"proj_size": 2}), "gru": (nn.GRU, {}),
         "rnn_tanh": (nn.RNN, {}), "rnn_relu": (nn.RNN, {"nonlinearity": "relu"})}


class SeqNet(nn.Module):
    """Linear (its input gradient checks the RNN's) → the RNN (padded or packed, h0/c0 from a Linear of a
    per-example context or none) → Linear on [mean of the outputs; h_n; c_n]."""

    def __init__(self, c, dropout=0.0):
        super().__init__()
        self.c = c
        cls, kw = CELLS[c["cell"]]
        d, H, L, D = c["d"], c["H"], c["L"], 2 if c["bi"] else 1
        self.P = kw.get("proj_size") or H
        self.pre = nn.Linear(d, d)
        self.rnn = cls(d, H, num_layers=L, bias=c["bias"], batch_first=c["bf"], bidirectional=c["bi"],
                       dropout=dropout, **kw)
        self.lstm = cls is nn.LSTM
        self.h0 = nn.Linear(d, L * D * self.P) if c["h0"] else None
        self.c0 = nn.Linear(d, L * D * H) if c["h0"] and self.lstm else None
        self.head = nn.Linear(D * self.P + L * D * self.P + (L * D * H if self.lstm else 0), 2)

    def forward(self, x, lengths, ctx):
        c, B, T = self.c, x.shape[0], x.shape[1]
        z = torch.tanh(self.pre(x))
        if not c["bf"]:
            z = z.transpose(0, 1)
        if c["packed"]:
            z = pack_padded_sequence(z, lengths, batch_first=c["bf"], enforce_sorted=c["packed"] == "sorted")
        hx = None
        if self.h0 is not None:
            LD = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
            h0 = torch.tanh(self.h0(ctx)).view(B, LD, self.P).transpose(0, 1)
            hx = (h0, self.c0(ctx).view(B, LD, self.rnn.hidden_size).transpose(0, 1)) if self.lstm else h0
        out, h = self.rnn(z, hx) if hx is not None else self.rnn(z)
        if c["packed"]:
            assert isinstance(out, PackedSequence)
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=T)
        elif not c["bf"]:
            out = out.transpose(0, 1)
        states = list(h) if self.lstm else [h]
        feats = [out.mean(1)] + [s.transpose(0, 1).reshape(B, s.shape[0] * s.shape[2]) for s in states]
        return self.head(torch.cat(feats, 1))


def seq_data(c, B, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, c["T"], c["d"], generator=g)
    lengths = torch.randint(1, c["T"] + 1, (B,), generator=g)
    if c["packed"] == "sorted":
        lengths = lengths.sort(descending=True).values
    return x, lengths, torch.randn(B, c["d"], generator=g), torch.randn(B, 2, generator=g)


def seq_loss(data):
    """loss_of for :func:`check_engine_against_loop`: 0.5‖out_i − y_i‖² of the examples ``idx`` run together."""
    x, lengths, ctx, y = data

    def loss_of(model, idx, dtype):
        out = model(x[idx].to(dtype), lengths[idx], ctx[idx].to(dtype))
        return 0.5 * (out - y[idx].to(dtype)).pow(2).sum(1)
    return loss_of


@st.composite
def rnn_cases(draw):
    return dict(cell=draw(st.sampled_from(list(CELLS))), L=draw(st.integers(1, 3)), bi=draw(st.booleans()),
                bf=draw(st.booleans()), bias=draw(st.booleans()), packed=draw(st.sampled_from([None, "sorted", "unsorted"])),
                h0=draw(st.booleans()), d=draw(st.integers(1, 3)), H=draw(st.integers(3, 4)), T=draw(st.integers(1, 5)))


@settings(deadline=None, max_examples=EXAMPLES + 30)
@given(c=rnn_cases(), clip=clip_st)
def test_rnn_matches_per_example_oracle(c, clip):
    B = clip["B"] if not c["packed"] else max(clip["B"], 1)  # a PackedSequence cannot be empty
    torch.manual_seed(clip["seed"])
    model = SeqNet(c)
    engine = check_engine_against_loop(model, seq_loss(seq_data(c, B, clip["seed"])), B, clip,
                                       force_path(clip["path"]))
    assert "rnn" in engine.last_paths  # the RNN ran through its rule


def _case(**kw):
    return dict(dict(cell="lstm", L=2, bi=True, bf=True, bias=True, packed="unsorted", h0=True, d=3, H=4, T=5), **kw)


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
@pytest.mark.parametrize("path", ["ghost", "inst", "reuse"])
def test_every_cell_and_path_on_packed_bidirectional_stack(cell, clipping, path):
    """Each cell, two bidirectional layers, unsorted packed sequences, a computed h0, every forced path."""
    c = _case(cell=cell)
    torch.manual_seed(1)
    clip = dict(clipping=clipping, clipping_fn="abadi", C=0.05)
    x, _, ctx, y = seq_data(c, 3, 1)
    lengths = torch.tensor([2, 5, 3])  # packed order 1, 2, 0: per-example values must be mapped back
    engine = check_engine_against_loop(SeqNet(c), seq_loss((x, lengths, ctx, y)), 3, clip, force_path(path))
    assert engine.last_paths["rnn"] in (
        {"ghost", "instantiate", "mixed"} if path != "reuse" else {"reuse", "mixed"})


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("packed", [None, "unsorted"])
@pytest.mark.parametrize("bf", [True, False])
def test_inter_layer_dropout_matches_pytorch_and_per_example_oracle(cell, packed, bf):
    """Dropout between layers: the rule draws PyTorch's masks (same seed, CPU) and keeps them for its
    backward, so (a) C = ∞ gives B × PyTorch's own mean gradient and (b) a finite C matches each example's
    gradient backpropagated through PyTorch's own batch forward with that seed."""
    c = _case(cell=cell, L=3, packed=packed, bf=bf)
    torch.manual_seed(0)
    model = SeqNet(c, dropout=0.4)
    data = seq_data(c, 3, 0)
    loss_of = seq_loss(data)
    torch.manual_seed(7)
    loss_of(model, [0, 1, 2], torch.float32).mean().backward()
    expected = {n: 3 * p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    engine = PerSampleEngine(model, max_grad_norm=math.inf).attach()
    torch.manual_seed(7)
    with engine.micro_batch(batch_size=3):
        loss_of(model, [0, 1, 2], torch.float32).mean().backward()
    engine.detach()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-4, atol=1e-5, msg=n)
    clip = dict(clipping="all-layer", clipping_fn="abadi", C=0.05)
    check_engine_against_loop(model, loss_of, 3, clip, alone=False, seed=7)


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("packed", [None, "unsorted"])
def test_outputs_and_input_gradients_equal_pytorch(cell, packed):
    """Outputs (PackedSequence data and order, h_n, c_n) and the gradients of the input and h0/c0 equal
    PyTorch's own to float32 rounding; the result has PyTorch's types."""
    c = _case(cell=cell, packed=packed)
    cls, kw = CELLS[cell]
    torch.manual_seed(0)
    rnn = cls(3, 4, num_layers=2, bidirectional=True, batch_first=True, **kw)
    x, lengths, _, _ = seq_data(c, 3, 0)
    P = kw.get("proj_size") or 4
    h0 = torch.randn(4, 3, P)
    hx = (h0, torch.randn(4, 3, 4)) if cls is nn.LSTM else h0

    def run(use_engine):
        xs = x.clone().requires_grad_(True)
        hs = [t.clone().requires_grad_(True) for t in (hx if isinstance(hx, tuple) else (hx,))]
        inp = pack_padded_sequence(xs, lengths, batch_first=True, enforce_sorted=False) if packed else xs
        out, h = rnn(inp, tuple(hs) if len(hs) == 2 else hs[0])
        data = out.data if packed else out
        states = h if isinstance(h, tuple) else (h,)
        loss = (data * torch.linspace(-1, 1, data.numel()).view_as(data)).sum() + sum(s.pow(2).sum() for s in states)
        (loss / 3 if use_engine else loss).backward()
        return out, h, xs.grad * (3 if use_engine else 1), [t.grad * (3 if use_engine else 1) for t in hs]

    ref = run(False)
    engine = PerSampleEngine(rnn, max_grad_norm=math.inf).attach()
    with engine.micro_batch(batch_size=3):
        got = run(True)
    engine.detach()
    assert type(got[0]) is type(ref[0]) and type(got[1]) is type(ref[1])
    if packed:
        for a, b in zip(got[0][1:], ref[0][1:]):  # batch_sizes, sorted_indices, unsorted_indices
            assert torch.equal(a, b)
    flat = lambda r: [r[0].data if packed else r[0], *(r[1] if isinstance(r[1], tuple) else (r[1],)), r[2], *r[3]]
    for a, b in zip(flat(got), flat(ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_batch_is_read_from_dimension_one_with_batch_first_false():
    """(T, B, d) with batch_first=False is B examples, never T; (B, T, d) given to it by mistake is refused."""
    rnn = nn.GRU(3, 4)
    engine = PerSampleEngine(rnn).attach()
    with engine.micro_batch(batch_size=2):
        rnn(torch.randn(5, 2, 3))[0].sum().backward()
    assert rnn.weight_ih_l0.grad is not None
    with engine.micro_batch(batch_size=2), pytest.raises(UnsupportedLayerError, match=r"batch dimension \(1\) is 5"):
        rnn(torch.randn(2, 5, 3))


def test_unbatched_input_is_refused_and_eval_is_pytorch():
    rnn = nn.LSTM(3, 4, batch_first=True)
    x = torch.randn(2, 5, 3)
    with torch.no_grad():
        before = rnn(x)[0]
    engine = PerSampleEngine(rnn).attach()
    with engine.micro_batch(batch_size=5), pytest.raises(UnsupportedLayerError, match="batched input"):
        rnn(torch.randn(5, 3))
    rnn.eval()
    with torch.no_grad():
        torch.testing.assert_close(rnn(x)[0], before)
