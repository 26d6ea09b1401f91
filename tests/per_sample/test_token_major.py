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


def test_gathered_rows_at_a_dedicated_rule_match_the_oracle():
    """The rows reversed (gathered by an index) before the LayerNorm and Linear: each laid out per example."""
    torch.manual_seed(0)
    model, (x, y) = _FlatMLP("gather"), _data()
    ref = clipped_sum(model, per_example_grads_loop(model, F.cross_entropy, x, y), 0.1, "all-layer")
    _check(model, x, y)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=0, atol=1e-6)


# ------------------------------------------------------------------- rows gathered by an index at dedicated rules
V, KEEP = 16, 8  # vocabulary; the tokens with ids ≥ KEEP also go through the gathered embedding and norms


class _Gathered(nn.Module):
    """Every rule that takes gathered rows: a Mixtral-like MoE of nn.Linear experts (top-2 of 6), and an Embedding,
    LayerNorm and RMSNorm on the tokens with ids ≥ ``keep`` (``torch.where``), added back with ``index_add``."""

    def __init__(self, dispatch="where", keep=KEEP):
        super().__init__()
        from zoo_moe import LinearExpertsMoE

        self.tok, self.picked, self.keep = nn.Embedding(V, D), nn.Embedding(V, D), keep
        self.ln, self.rms, self.head = nn.LayerNorm(D), nn.RMSNorm(D, eps=1e-6), nn.Linear(D, 3)
        self.moe = LinearExpertsMoE(D, 8, experts=6, top_k=2, dispatch=dispatch)

    def forward(self, ids):  # (B, T)
        flat, idx = self.tok(ids).reshape(-1, D), ids.reshape(-1)
        kept = torch.where(idx >= self.keep)[0]
        extra = self.rms(self.ln(flat[kept]) + self.picked(idx[kept]))
        h = flat.index_add(0, kept, extra).view(*ids.shape, D)
        return self.head((h + self.moe(h)).mean(1))


def _ids(n=4):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (n, 4), generator=g)
    ids[1] = ids[1] % KEEP  # example 1: no token kept
    return ids, torch.randint(0, 3, (n,), generator=g)


def _routes(model, ids):
    """Rows each example sends to each expert, (B, E)."""
    with torch.no_grad():
        h = model.tok(ids).reshape(-1, D)
        kept = torch.where(ids.reshape(-1) >= model.keep)[0]
        h = h.index_add(0, kept, model.rms(model.ln(h[kept]) + model.picked(ids.reshape(-1)[kept])))
        chosen = model.moe.gate(h).topk(2, dim=-1).indices.view(ids.shape[0], -1)
    return torch.stack([(chosen == e).sum(1) for e in range(len(model.moe.experts))], 1)


@pytest.mark.parametrize("clipping,mode", [("all-layer", "book-keeping"), ("all-layer", "two-pass"),
                                           ("layer-wise", "book-keeping")])
@pytest.mark.parametrize("dispatch", ["where", "index_select", "mask"])
def test_gathered_rows_match_the_float64_oracle(dispatch, clipping, mode):
    """Σ_i clip(g_i) of the engine in float64 equals the per-example backward loop's to 1e-8 (the engine forms the
    norms and coefficients in float32: 1e-9 here; a row given to another example: 1e-1), with examples that
    route no token to some expert, one that keeps no token for the gathered embedding and norms, and every
    group clipped (C small)."""
    torch.manual_seed(0)
    model, (ids, y) = _Gathered(dispatch).double(), _ids()
    routes = _routes(model, ids)
    assert (routes == 0).any() and (routes >= 2).any()  # segments of 0 rows and of several
    ref = clipped_sum(model, per_example_grads_loop(model, F.cross_entropy, ids, y), 0.05, clipping)
    engine = PerSampleEngine(model, max_grad_norm=0.05, clipping=clipping, clipping_mode=mode).attach()
    try:
        assert engine.check_layout(lambda i: F.cross_entropy(model(ids if i is None else ids[i]),
                                                             y if i is None else y[i]), ids.shape[0])
        with engine.micro_batch(batch_size=ids.shape[0]):
            backward(engine, F.cross_entropy(model(ids), y))
    finally:
        engine.detach()
    assert engine.stats["clipped"] == ids.shape[0]
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=1e-8, msg=lambda m: f"{n}: {m}")


def test_gathered_rows_of_no_example_give_zero_gradients():
    """No token kept at all: the embedding and the norms are called on zero rows, and their clipped sums are 0."""
    torch.manual_seed(0)
    model, (ids, y) = _Gathered(keep=V).double(), _ids()
    ref = clipped_sum(model, per_example_grads_loop(model, F.cross_entropy, ids, y), 0.05, "layer-wise")
    engine = PerSampleEngine(model, max_grad_norm=0.05, clipping="layer-wise").attach()
    try:
        with engine.micro_batch(batch_size=ids.shape[0]):
            F.cross_entropy(model(ids), y).backward()
    finally:
        engine.detach()
    for n, p in model.named_parameters():
        if n.startswith(("picked", "ln", "rms")):
            assert not p.grad.any(), n
        torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=1e-8, msg=lambda m: f"{n}: {m}")


def test_gathered_rows_as_many_as_the_examples_are_not_taken_for_the_batch():
    """An expert given exactly B rows (here B = 4 of the 16 tokens' 32 picks): its input's shape looks batch first,
    its row map says otherwise, and the map wins (each row's gradient goes to its own example)."""
    from zoo_moe import LinearExpertsMoE

    torch.manual_seed(0)
    model = nn.Sequential(LinearExpertsMoE(D, 8, experts=6, top_k=2)).double()
    x = torch.randn(4, 4, D, dtype=torch.float64)
    with torch.no_grad():
        chosen = model[0].gate(x.reshape(-1, D)).topk(2, dim=-1).indices
    assert 4 in [int((chosen == e).sum()) for e in range(6)]
    ref = clipped_sum(model, per_example_grads_loop(model, lambda out, y: out.sum(), x, torch.zeros(4)), 1e-4,
                      "layer-wise")
    engine = PerSampleEngine(model, max_grad_norm=1e-4).attach()
    try:
        with engine.micro_batch(batch_size=4):
            model(x).sum((1, 2)).mean().backward()
    finally:
        engine.detach()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=1e-8, msg=lambda m: f"{n}: {m}")


def test_gathered_rows_at_a_rule_that_is_not_row_wise_are_refused():
    """A convolution on gathered rows (R, C, L) cannot take them laid out (B, n, C, L): refused before any update,
    naming the layer."""
    class ConvOnGathered(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.conv = nn.Linear(D, D), nn.Conv1d(2, 2, 3, padding=1)

        def forward(self, x):
            rows = self.fc(x).reshape(-1, 2, D // 2)
            return self.conv(rows[torch.arange(rows.shape[0] - 1, -1, -1)]).view(x.shape[0], -1).sum(1)

    model, x = ConvOnGathered(), torch.randn(B, T, D)
    engine = PerSampleEngine(model, max_grad_norm=1.0).attach()
    try:
        with pytest.raises(UnsupportedLayerError, match="Conv1d 'conv'.*gathered from the examples by an index"):
            with engine.micro_batch(batch_size=B):
                model(x).sum().backward()
        assert model.fc.weight.grad is None
    finally:
        engine.detach()


def test_the_layout_check_proves_the_map():
    """An in-place write through a view puts other examples' rows behind a map the tracker keeps: the layout
    check's re-indexed forward sees the rows not follow their examples and refuses before any update."""
    torch.manual_seed(0)
    with pytest.raises(UnsupportedLayerError, match="layout check failed"):
        _check(_FlatMLP("in place"), *_data(4))
