"""Token-major layers (per_sample/provenance.py, per_sample/token_major.py): the row maps the tracker forms, the
refusals where it loses them or where rows are gathered, and the layout check proving a map the tracker cannot
see broken. The HF models (OPT, Mixtral, Qwen2-MoE, Swin) against the oracle are in test_zoo.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpzero.per_sample import PerSampleEngine
from lightning_dpzero.per_sample.base import UnsupportedLayerError
from lightning_dpzero.per_sample.provenance import RowTracker, Rows, by_example, lost_at, mark, rows_of
from oracle import backward, clipped_sum, per_example_grads_loop

B, T, D = 3, 4, 6


def _batch(*shape):
    x = torch.randn(*shape)
    mark(x, Rows(shape[0]))
    return x


def test_reshape_merges_and_splits_the_batch():
    x = _batch(B, T, D)
    with RowTracker():
        flat = x.reshape(-1, D)
        back = (flat * 2 + 1).view(B, T, D)
        pairs = flat.view(B * T // 2, 2 * D)  # two rows of one example per row: T even
        halves = flat.view(B * 2, T * D // 2)  # an example's 24 numbers in rows of 12: each row one example's
        mixed = flat.view(8, 9)  # rows of 9 of the examples' 24 numbers: a row spans two examples
    assert rows_of(flat).m == T and rows_of(flat).b == B
    assert rows_of(back).m == 1
    assert rows_of(pairs).m == T // 2 and rows_of(halves).m == 2
    assert rows_of(mixed) is None and lost_at(mixed) is not None


def test_window_partition_keeps_example_then_window():
    """Swin's view → permute → view: rows (example, window), each example's windows contiguous."""
    x = _batch(B, 4, 4, D)
    with RowTracker():
        w = x.view(B, 2, 2, 2, 2, D).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, 4, D)
        swapped = x.permute(1, 0, 2, 3)  # the batch no longer first
    assert rows_of(w).m == 4 and rows_of(w).blocks
    assert torch.equal(by_example(w, rows_of(w))[1], w[4:8])
    assert rows_of(swapped) is None and lost_at(swapped) == "permute"


def test_gather_by_an_index_maps_rows_to_their_examples():
    """An MoE dispatch: tokens gathered by index, a table looked up by a mapped index."""
    x = _batch(B, T, D)
    idx = torch.tensor([11, 0, 5, 4, 4])
    with RowTracker():
        flat = x.reshape(-1, D)
        got, sel = flat[idx], torch.index_select(flat, 0, idx)
        topk = flat.softmax(-1).topk(2, dim=-1).indices  # (B·T, 2), rows kept
        table = torch.randn(D, 3)[topk]  # a shared table at mapped indices: the indices' rows
    for t in (got, sel):
        assert torch.equal(rows_of(t).examples(), idx // T)
    assert rows_of(topk).same(rows_of(flat)) and rows_of(table).same(rows_of(flat))
    assert len(by_example(got, rows_of(got))[1]) == 3  # example 1: rows 5, 4 and 4


def test_a_value_expanded_over_the_rows_keeps_the_map():
    """Swin's shifted-window mask: (windows, N, N) expanded over the batch and flattened with it, added to the
    (example, window) rows' scores: it has no rows of its own, so the scores keep their map."""
    scores = _batch(B, 4, 2, 2)
    mask = torch.randn(4, 2, 2)
    with RowTracker():
        s = scores.reshape(-1, 2, 2)
        m = mask.unsqueeze(0).expand(B, -1, -1, -1).reshape(-1, 2, 2)
        out = (s + m).softmax(-1)
        unknown = s + torch.randn(B * 4, 2, 2)  # rows of its own, from nowhere the tracker saw
    assert rows_of(out).same(rows_of(s)) and rows_of(s).m == 4
    assert rows_of(m) is None and lost_at(m) is None
    assert lost_at(unknown) == "add"


def test_convolutions_and_pooling_of_a_batched_input_keep_the_map():
    """A frozen patch embedding (Swin's with LoRA: no rule seeds its output) convolves and pools each example
    alone; an unbatched input's first dimension is its channels, not the rows."""
    x = _batch(B, 1, 8, 8)
    with RowTracker():
        patches = F.conv2d(x, torch.randn(4, 1, 2, 2), stride=2)  # (B, 4, 4, 4)
        pooled = F.adaptive_avg_pool2d(F.max_pool2d(patches, 2), 1)
        rows = patches.flatten(2).transpose(1, 2).reshape(-1, 4)  # (B·16, 4): the tokens as rows
        unbatched = F.conv1d(rows[:, :2].t(), torch.randn(3, 2, 1))  # (2, B·16) read as (channels, length)
    assert rows_of(patches).same(Rows(B)) and rows_of(pooled).same(Rows(B)) and rows_of(rows).m == 16
    assert rows_of(unbatched) is None and lost_at(unbatched) is not None


def test_an_op_that_mixes_rows_loses_the_map():
    x = _batch(B, T, D)
    with RowTracker():
        flat = x.reshape(-1, D)
        rolled = torch.roll(flat, 1, 0)
        cumulative = flat.cumsum(0)
        unmapped = flat + torch.randn(B * T, D)  # an operand with rows of its own
        kept = flat + torch.randn(D)  # broadcast
    for t, op in ((rolled, "roll"), (cumulative, "cumsum"), (unmapped, "add")):
        assert rows_of(t) is None and lost_at(t) == op
    assert rows_of(kept).m == T


class _FlatMLP(nn.Module):
    """OPT's pattern: the feed-forward on (B·T, d) rows, then back to (B, T, d); ``how`` breaks it."""

    def __init__(self, how="reshape"):
        super().__init__()
        self.emb, self.fc, self.ln, self.head, self.how = nn.Linear(D, D), nn.Linear(D, D), nn.LayerNorm(D), \
            nn.Linear(D, 3), how

    def forward(self, x):
        h = self.emb(x)
        flat = h.reshape(-1, D)
        if self.how == "roll":
            flat = torch.roll(flat, 1, 0)
        elif self.how == "gather":
            flat = flat[torch.arange(flat.shape[0] - 1, -1, -1)]
        elif self.how == "in place":  # writes other examples' rows into the storage behind the map
            flat = flat.clone()
            flat[1:].add_(flat[:-1].clone())
        out = self.fc(self.ln(flat))
        if self.how == "gather":
            out = out[torch.arange(out.shape[0] - 1, -1, -1)]
        return self.head(out.view(x.shape[0], -1, D).mean(1))


def _data(n=B):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, T, D, generator=g), torch.randint(0, 3, (n,), generator=g)


def _check(model, x, y):
    engine = PerSampleEngine(model, max_grad_norm=0.1, clipping="all-layer").attach()
    try:
        engine.check_layout(lambda i: F.cross_entropy(model(x if i is None else x[i]), y if i is None else y[i]),
                            x.shape[0])
        model.zero_grad(set_to_none=True)
        with engine.micro_batch(batch_size=x.shape[0]):
            backward(engine, F.cross_entropy(model(x), y))
    finally:
        engine.detach()
    return engine


def test_a_reshaped_linear_and_layernorm_match_the_oracle():
    torch.manual_seed(0)
    model, (x, y) = _FlatMLP(), _data()
    ref = clipped_sum(model, per_example_grads_loop(model, F.cross_entropy, x, y), 0.1, "all-layer")
    engine = _check(model, x, y)
    assert engine.tracking.needed  # the check saw token-major layers: rows tracked in training
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=0, atol=1e-6)


def test_a_lost_map_is_refused_with_the_operation():
    torch.manual_seed(0)
    with pytest.raises(UnsupportedLayerError, match="'roll'"):
        _check(_FlatMLP("roll"), *_data())


def test_gathered_rows_at_a_dedicated_rule_are_refused():
    torch.manual_seed(0)
    with pytest.raises(UnsupportedLayerError, match="gathered from the examples by an index"):
        _check(_FlatMLP("gather"), *_data())


def test_the_layout_check_proves_the_map():
    """An in-place write through a view puts other examples' rows behind a map the tracker keeps: the layout
    check's re-indexed forward sees the rows not follow their examples and refuses before any update."""
    torch.manual_seed(0)
    with pytest.raises(UnsupportedLayerError, match="layout check failed"):
        _check(_FlatMLP("in place"), *_data(4))
