"""The per-example layout check (per_sample/layout.py): before the first update, every layer's input is proven
batch first and per example, whatever the sampler and whether or not T == B (docs/design.md, I5). The two
layouts that trained silently wrong before it (a time-first stack with T == B, an input shared by every
example with L == B) are refused with the fix; models that are per-example pass."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpzero import DPDeepSpeedStrategy
from lightning_dpzero.per_sample import PerSampleEngine, UnsupportedLayerError
from lightning_dpzero.per_sample.layout import index_map, reindex_batch
from models import ConvNet, TimeFirstNet, TinyViT, TokenNet
from oracle import clipped_sum, per_example_grads


def _run(model, x, y):
    return lambda i: F.cross_entropy(model(x if i is None else x[i]), y if i is None else y[i])


def _check(model, x, y, collectives=None):
    engine = PerSampleEngine(model).attach()
    try:
        return engine.check_layout(_run(model, x, y), x.shape[0], collectives)
    finally:
        engine.detach()


class SharedBias(nn.Module):
    """A relative-position bias as T5 computes it: an embedding of (L, L) buckets, broadcast over the batch."""

    def __init__(self, d=4):
        super().__init__()
        self.lin, self.bias, self.head = nn.Linear(d, d), nn.Embedding(5, 1), nn.Linear(d, 3)

    def forward(self, x):
        L = x.shape[1]
        buckets = (torch.arange(L)[:, None] - torch.arange(L)[None]).abs().clamp(max=4)
        scores = torch.einsum("btd,bsd->bts", self.lin(x), x) + self.bias(buckets)[..., 0]  # (B, L, L) + (L, L)
        return self.head(torch.softmax(scores, -1) @ x).mean(1)


class Centred(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.lin, self.head = nn.Linear(d, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.lin(x)
        return self.head(h - h.mean(0)).mean(1)


@pytest.mark.parametrize("T", [3, 5])  # T == B passes every shape check; T != B too, here
def test_time_first_stack_is_refused_with_the_fix(T):
    torch.manual_seed(0)
    with pytest.raises(UnsupportedLayerError) as err:
        _check(TimeFirstNet(), torch.randn(3, T, 4), torch.randint(0, 3, (3,)))
    lines = str(err.value).splitlines()
    assert len(lines) == 4  # header, one line per class (Linear, LayerNorm), the off switch
    assert lines[1].startswith("  - Linear 'l1', 'l2': its input has the batch in its second dimension")
    assert lines[2].startswith("  - LayerNorm 'ln':") and "keep the activations batch first" in lines[2]
    assert "'head'" not in str(err.value)  # batch first again: it follows its examples


@pytest.mark.parametrize("L_", [3, 4])  # L == B (indices that look batch first) and L != B
def test_an_input_shared_by_every_example_trains_per_example_where_it_is_broadcast(L_):
    torch.manual_seed(1)
    model = SharedBias()
    x, y = torch.randn(3, L_, 4), torch.randint(0, 3, (3,))
    ref = clipped_sum(model, per_example_grads(model, F.cross_entropy, x, y), 0.05, "layer-wise")
    engine = PerSampleEngine(model, max_grad_norm=0.05).attach()
    # L == B: the check sees the buckets shared, and the engine then treats them so (without it, they look batch first)
    assert engine.check_layout(_run(model, x, y), 3)
    with engine.micro_batch(batch_size=3):
        F.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-7, msg=n)


def test_statistics_over_the_batch_are_refused():
    torch.manual_seed(2)
    with pytest.raises(UnsupportedLayerError, match=r"Linear 'head': row i of its input depends on other examples"):
        _check(Centred(), torch.randn(4, 3, 4), torch.randint(0, 3, (4,)))


@pytest.mark.parametrize("make, x", [
    (TokenNet, lambda b: torch.randint(0, 13, (b, 6))), (ConvNet, lambda b: torch.randn(b, 1, 8, 8)),
    (TinyViT, lambda b: torch.randn(b, 1, 8, 8)),
    (lambda: nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True), nn.Flatten(),
                           nn.Linear(8 * 5, 3)), lambda b: torch.randn(b, 5, 8)),
])
@pytest.mark.parametrize("b", [2, 5])
def test_per_example_models_pass_and_keep_their_modes_and_random_stream(make, x, b):
    torch.manual_seed(3)
    model = make().train()
    inputs, y = x(b), torch.randint(0, 3, (b,))
    state = torch.get_rng_state()
    assert _check(model, inputs, y)
    assert all(m.training for m in model.modules())
    assert torch.equal(torch.get_rng_state(), state)


def test_a_micro_batch_of_fewer_than_two_examples_leaves_the_check_pending():
    torch.manual_seed(4)
    model = TokenNet()
    engine = PerSampleEngine(model).attach()
    for b in (0, 1):
        x, y = torch.randint(0, 13, (b, 6)), torch.randint(0, 3, (b,))
        assert not engine.check_layout(_run(model, x, y), b)
    x, y = torch.randint(0, 13, (3, 6)), torch.randint(0, 3, (3,))
    assert engine.check_layout(_run(model, x, y), 3) and engine.layout_verified
    assert engine.check_layout(lambda i: pytest.fail("checked twice"), 3)  # once proven, never run again


def test_a_shared_input_with_one_example_is_a_shared_value():
    assert not _check(SharedBias(), torch.randn(1, 3, 4), torch.randint(0, 3, (1,)))  # passed, B < 2: pending


class _Ranks:
    """Two ranks as the check sees them, this one rank 0: the other rank's flags (failed, pending, check again,
    and 0 for "rank 0 failed") are added by ``reduce``."""

    world_size, global_rank = 2, 0

    def __init__(self, other):
        self.other = torch.tensor([*other, 0.0], dtype=torch.float32)

    def reduce(self, t, reduce_op="sum"):
        assert reduce_op == "sum"
        return t + self.other


def test_the_ranks_agree_in_one_all_reduce():
    torch.manual_seed(5)
    model, x, y = TokenNet(), torch.randint(0, 13, (3, 6)), torch.randint(0, 3, (3,))
    with pytest.raises(UnsupportedLayerError, match="failed on 1 other rank"):
        _check(model, x, y, _Ranks([1.0, 0.0, 0.0]))
    assert not _check(model, x, y, _Ranks([0.0, 1.0, 0.0]))  # the other rank had fewer than two examples
    assert _check(model, x, y, _Ranks([0.0, 0.0, 0.0]))


def test_reindex_batch_walks_the_batch_and_indexes_only_batch_first_tensors():
    s = index_map(4)
    assert s[0] == s[1] and sorted(set(s.tolist())) != list(range(4)) and len(s) == 4
    batch = {"ids": torch.arange(8).view(4, 2), "mask": torch.ones(3, 3), "n": 7, "pair": (torch.arange(4), "a")}
    out = reindex_batch(batch, s)
    assert torch.equal(out["ids"], batch["ids"][s]) and out["mask"] is batch["mask"] and out["n"] == 7
    assert torch.equal(out["pair"][0], s) and out["pair"][1] == "a"
    assert reindex_batch(batch, None) is batch


# ---------------------------------------------------------------------------------------------- with the strategy
class Module(L.LightningModule):
    def __init__(self, net, n=12):
        super().__init__()
        self.net, self.n, self.steps = net, n, 0

    def training_step(self, batch, _):
        if torch.is_grad_enabled():
            self.steps += 1
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, batch_size=len(x))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def data(self):
        g = torch.Generator().manual_seed(0)
        return torch.randn(self.n, 3, 4, generator=g), torch.randint(0, 3, (self.n,), generator=g)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*self.data()), batch_size=3)


def _fit(module, **kw):
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=0.0, max_grad_norm=0.05, seed=0, **kw)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return trainer


@pytest.mark.parametrize("poisson", [True, False])
def test_the_strategy_refuses_a_time_first_model_before_any_update(poisson):
    torch.manual_seed(6)
    module = Module(TimeFirstNet())
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(UnsupportedLayerError, match="layout check failed"):
        for _ in range(20):  # Poisson batches: until one of two or more examples is checked
            _fit(module, poisson_sampling=poisson)
    assert module.steps == 0
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_without_the_check_the_time_first_model_trains_wrong():
    """What the check prevents: turned off (with a warning), the same model trains without an error, and its
    update is not Σ_i clip(g_i) / B_exp (the engine clipped per time step). The step's batch is the whole
    dataset of 3 examples (fixed batches of 3), so the oracle needs no record of the sampler."""
    torch.manual_seed(6)
    module = Module(TimeFirstNet(), n=3)
    init = {n: p.detach().clone() for n, p in module.net.named_parameters()}
    with pytest.warns(UserWarning, match="layout_check=False"):
        _fit(module, poisson_sampling=False, layout_check=False)
    assert module.steps == 1
    ref = TimeFirstNet()
    ref.load_state_dict(init)
    x, y = module.data()
    summed = clipped_sum(ref, per_example_grads(ref, F.cross_entropy, x, y), 0.05, "layer-wise")
    wrong = max(float((p.detach().double() - (init[n].double() - summed[n] / 3)).abs().max())
                for n, p in module.net.named_parameters())
    assert wrong > 1e-3, wrong  # the released update differs from the private one


@pytest.mark.slow
def test_time_first_model_is_refused_on_zero3_with_two_processes(tmp_path):
    """Every rank runs the same two forwards (ZeRO-3 gathers parameters collectively) and both refuse."""
    from harness import run_cases

    case = dict(name="timefirst", model="timefirst", stage=3, sigma=0.0, C=1.0, clipping="all-layer",
                clipping_fn="abadi", poisson=False, accumulate=1, steps=2, n=24, batch_size=3, lr=0.1)
    with pytest.raises(RuntimeError, match=r"(?s)layout check failed.*Linear 'net\.l1', 'net\.l2'"):
        run_cases([case], tmp_path, world_size=2, timeout=300)
    # both refuse; rank 0 prints the message, rank 1 one line naming the error
    assert "layout check failed" in (tmp_path / "rank0.log").read_text()
    assert "stopped: UnsupportedLayerError (rank 0 prints the message)" in (tmp_path / "rank1.log").read_text()


class _Packed(nn.Module):
    """Embedding -> LSTM on packed sequences of unequal lengths (original order restored) -> GRU time-first."""

    def __init__(self, mix=False):
        super().__init__()
        self.emb, self.lstm, self.gru = nn.Embedding(13, 4), nn.LSTM(4, 4, batch_first=True), nn.GRU(4, 4)
        self.head, self.mix = nn.Linear(4, 3), mix

    def forward(self, x):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        h = self.emb(x)
        packed = pack_padded_sequence(h, (x != 0).sum(1).clamp_min(1), batch_first=True, enforce_sorted=False)
        h = pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=x.shape[1])[0]
        h = h.transpose(0, 1)  # (T, B, d), as the GRU (batch_first=False) expects
        if self.mix:  # a statistic over the batch before the GRU: per-example gradients do not exist
            h = h - h.mean(1, keepdim=True)
        return self.head(self.gru(h, torch.zeros(1, x.shape[0], 4))[0][-1])


class _Bags(nn.Module):
    """EmbeddingBag on 1-D indices with offsets (bags of unequal lengths) and per-sample weights."""

    def __init__(self):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(13, 4, mode="sum"), nn.Linear(4, 3)

    def forward(self, x):
        lengths = (x != 0).sum(1)
        keep = torch.arange(x.shape[1]) < lengths.unsqueeze(1)
        offsets = torch.cumsum(lengths, 0) - lengths
        return self.head(self.bag(x[keep], offsets, per_sample_weights=x[keep].float() / 13))


def _ragged_tokens(b, T=6):
    x = torch.randint(1, 13, (b, T))
    x[torch.arange(T) >= torch.randint(1, T + 1, (b, 1))] = 0
    return x


@pytest.mark.parametrize("b", [2, 6])  # b == T: the GRU's time-first input has T == B
def test_rnn_and_bag_layouts_are_read_through_their_rules(b):
    """An RNN's input is compared batch first (time-first GRU input, packed LSTM sequences, the initial state)
    and an EmbeddingBag's 1-D indices bag by bag: these per-example models pass; without the rules' view the
    check refused them as time-first / not batch first."""
    torch.manual_seed(1)
    for model in (_Packed(), _Bags()):
        x = _ragged_tokens(b)
        assert _check(model, x, torch.randint(0, 3, (b,)))


def test_an_rnn_fed_a_mixed_batch_is_still_refused():
    torch.manual_seed(1)
    x = _ragged_tokens(4)
    with pytest.raises(UnsupportedLayerError, match="GRU 'gru': row i of its input depends on other examples"):
        _check(_Packed(mix=True), x, torch.randint(0, 3, (4,)))
