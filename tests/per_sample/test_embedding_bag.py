"""``nn.EmbeddingBag`` (docs/design.md, *The per-example engine*; I2 for one layer): example i is bag i. The
engine's Σ_i clip(g_i) against a float64 backward per bag of PyTorch's own module run on that bag alone, over
random configurations (hypothesis): mode sum/mean/max, 2-D indices or 1-D indices with offsets (with and
without ``include_last_offset``), empty bags, repeated indices, ``padding_idx``, ``per_sample_weights``
(computed by the model, so their gradient is checked too), B = 0..3, each clipping style and function; a
tied bag (one weight, two calls); the refusals.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from lightning_dpzero.per_sample import PerSampleEngine, UnsupportedLayerError
from oracle import check_engine_against_loop
from test_layers import EXAMPLES, clip_st


class BagNet(nn.Module):
    """EmbeddingBag (per-sample weights from a Linear of a per-example context, for mode sum; called a second
    time on shifted indices when ``tied``, so its norm sums two sites) → Linear. The bags come as padded
    ``(B, N)`` indices and lengths; for the 1-D forms the forward builds the flat indices and offsets."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.bag = nn.EmbeddingBag(c["V"], c["D"], mode=c["mode"], padding_idx=c["pad"],
                                   include_last_offset=c["form"] == "1d_last")
        with torch.no_grad():
            self.bag.weight.normal_()
        self.psw = nn.Linear(2, c["N"]) if c["psw"] else None
        self.head = nn.Linear(c["D"], 2)

    def _call(self, idx, lengths, w):
        if self.c["form"] == "2d":
            return self.bag(idx, per_sample_weights=w)
        keep = torch.arange(idx.shape[1]) < lengths.unsqueeze(1)  # (B, N): the first `length` of each row
        ends = torch.cumsum(lengths, 0)
        offsets = ends - lengths
        if self.c["form"] == "1d_last":
            offsets = torch.cat([offsets, ends[-1:] if len(ends) else ends.new_zeros(1)])
        return self.bag(idx[keep], offsets, per_sample_weights=None if w is None else w[keep])

    def forward(self, idx, lengths, ctx):
        w = torch.sigmoid(self.psw(ctx)) if self.psw is not None else None
        out = self._call(idx, lengths, w)
        if self.c["tied"]:
            out = out + self._call((idx + 1) % self.c["V"], lengths, None)
        return self.head(torch.tanh(out))


def bag_data(c, B, seed):
    """Bags of up to N indices (empty ones too in the 1-D forms), repeats (small V) and padding."""
    g = torch.Generator().manual_seed(seed)
    N = c["N"]
    idx = torch.randint(0, c["V"], (B, N), generator=g)
    lengths = torch.randint(0 if c["form"] != "2d" else N, N + 1, (B,), generator=g)
    return idx, lengths, torch.randn(B, 2, generator=g), torch.randn(B, 2, generator=g)


def bag_loss(data):
    idx, lengths, ctx, y = data

    def loss_of(model, sel, dtype):
        out = model(idx[sel], lengths[sel], ctx[sel].to(dtype))
        return 0.5 * (out - y[sel].to(dtype)).pow(2).sum(1)
    return loss_of


@st.composite
def bag_cases(draw):
    mode = draw(st.sampled_from(["sum", "mean", "max"]))
    form = draw(st.sampled_from(["2d", "1d", "1d_last"]))
    return dict(mode=mode, form=form, V=draw(st.integers(2, 6)), D=draw(st.integers(1, 4)), N=draw(st.integers(1, 4)),
                pad=draw(st.sampled_from([None, 0, 1])), psw=mode == "sum" and draw(st.booleans()),
                tied=draw(st.booleans()))


@settings(deadline=None, max_examples=EXAMPLES + 30)
@given(c=bag_cases(), clip=clip_st)
def test_embedding_bag_matches_per_example_oracle(c, clip):
    torch.manual_seed(clip["seed"])
    B = clip["B"]
    check_engine_against_loop(BagNet(c), bag_loss(bag_data(c, B, clip["seed"])), B, clip)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("form", ["2d", "1d", "1d_last"])
@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
def test_each_mode_and_form(mode, form, clipping):
    c = dict(mode=mode, form=form, V=5, D=3, N=4, pad=0, psw=mode == "sum", tied=mode == "mean")
    torch.manual_seed(3)
    clip = dict(clipping=clipping, clipping_fn="abadi", C=0.05)
    check_engine_against_loop(BagNet(c), bag_loss(bag_data(c, 3, 3)), 3, clip)


def test_batch_size_is_the_number_of_bags():
    """1-D indices with offsets: B = len(offsets) (−1 with include_last_offset), not the number of indices."""
    bag = nn.EmbeddingBag(5, 2, include_last_offset=True)
    engine = PerSampleEngine(bag).attach()
    idx, offsets = torch.tensor([1, 2, 3, 4, 1]), torch.tensor([0, 2, 5])
    with engine.micro_batch(batch_size=2):
        bag(idx, offsets).sum().backward()
    assert bag.weight.grad is not None
    with engine.micro_batch(batch_size=5), pytest.raises(UnsupportedLayerError, match="of 2 examples"):
        bag(idx, offsets)


@pytest.mark.parametrize("kw, attr", [(dict(max_norm=1.0), "max_norm"), (dict(scale_grad_by_freq=True), "scale_grad_by_freq"),
                                      (dict(sparse=True), "sparse")])
def test_refusals_name_the_setting_and_fix(kw, attr):
    with pytest.raises(UnsupportedLayerError, match=f"EmbeddingBag 'EmbeddingBag' sets {attr}=.*construct it with {attr}="):
        PerSampleEngine(nn.EmbeddingBag(5, 2, **kw)).attach()


def test_indices_without_bags_are_refused():
    bag = nn.EmbeddingBag(5, 2)
    engine = PerSampleEngine(bag).attach()
    with engine.micro_batch(batch_size=3), pytest.raises(UnsupportedLayerError, match="1-D indices with offsets"):
        bag(torch.tensor([[[1, 2]]]))
