"""Mixing the one-off layout check could not see (per_sample/mixing.py): a forward that mixes examples only in
training mode, one that starts to mix after a warm-up, and a loss that is not per example (a mean over the
batch's tokens, Hugging Face's ``labels=`` loss). Each is refused before the update it would spoil; the
per-sequence loss helper equals the per-example reference."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpzero import DPDeepSpeedStrategy
from lightning_dpzero.losses import causal_lm_loss, token_loss
from lightning_dpzero.per_sample import PerSampleEngine, UnsupportedLayerError


class TrainOnlyCentred(nn.Module):
    """Parameter-free mixing in training mode only: what a check run in eval mode passes."""

    def __init__(self, d=4):
        super().__init__()
        self.lin, self.drop, self.head = nn.Linear(d, 8), nn.Dropout(0.5), nn.Linear(8, 3)

    def forward(self, x):
        h = self.drop(self.lin(x))
        if self.training:
            h = h - h.mean(0)
        return self.head(h)


def _check(model, x, y, loss=F.cross_entropy, every_batch=False, times=1, reduction="mean"):
    engine = PerSampleEngine(model, loss_reduction=reduction).attach()
    try:
        for _ in range(times):
            engine.check_layout(lambda i: loss(model(x if i is None else x[i]), y if i is None else y[i]),
                                x.shape[0], every_batch=every_batch)
    finally:
        engine.detach()


def test_train_mode_only_mixing_is_refused_and_dropout_is_not_taken_for_mixing():
    torch.manual_seed(0)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with pytest.raises(UnsupportedLayerError, match=r"Linear 'head': row i of its input depends on other examples"):
        _check(TrainOnlyCentred().train(), x, y)
    _check(TrainOnlyCentred().eval(), x, y)  # the same model evaluated mixes nothing
    # dropout alone (modules switched off for the check's forwards) is not mixing
    _check(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3)).train(), x, y, times=3, every_batch=True)


def test_the_spot_check_runs_on_later_batches_only_when_asked():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    engine = PerSampleEngine(model).attach()
    calls = []

    def run(i):
        calls.append(None if i is None else i.tolist())
        return F.cross_entropy(model(x if i is None else x[i]), y if i is None else y[i])

    assert engine.check_layout(run, 6)
    first = len(calls)  # the full micro-batch, the re-indexed one, a pair, each of the pair alone
    assert first == 5 and calls[0] is None and len(calls[2]) == 2 and [calls[2][0]] == calls[3]
    engine.check_layout(run, 6)
    assert len(calls) == first  # first-batch: proven once
    engine.check_layout(run, 6, every_batch=True)
    assert len(calls) == first + 4 and calls[first] is None  # the full micro-batch, the pair, each alone


def test_a_token_mean_loss_and_a_loss_reduction_that_is_not_the_one_declared_are_refused():
    torch.manual_seed(2)
    emb, head = nn.Embedding(11, 8), nn.Linear(8, 11)
    model = nn.Sequential(emb, nn.Tanh(), head)
    with torch.no_grad():
        head.weight.mul_(20)  # per-example losses far apart, as in a trained model
    ids = torch.randint(1, 11, (4, 6))
    labels = ids.clone()
    labels[0, 2:], labels[2, 4:] = -100, -100  # padded: 6, 2, 6 and 4 tokens
    def flat(logits, lab):
        return F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100)

    with pytest.raises(UnsupportedLayerError, match=r"the loss mixes examples.*causal_lm_loss"):
        _check(model, ids, labels, loss=flat)
    _check(model, ids, labels, loss=lambda lo, la: token_loss(lo, la))  # the same tokens, per example
    with pytest.raises(UnsupportedLayerError, match=r"the loss is the sum .* loss_reduction='mean'"):
        _check(model, ids, labels, loss=lambda lo, la: token_loss(lo, la, reduction="sum"))
    _check(model, ids, labels, loss=lambda lo, la: token_loss(lo, la, reduction="sum"), reduction="sum")


# ---------------------------------------------------------------------------------------------- Hugging Face
def _llama(seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=24, max_position_embeddings=32,
                                      attn_implementation="eager")
    return transformers.LlamaForCausalLM(config)


def _padded(b=4, t=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 32, (b, t), generator=g)
    lengths = torch.tensor([t, 3, 6, 5][:b])
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def test_hugging_face_padded_labels_loss_is_refused_naming_the_helper():
    model = _llama().train()
    ids, mask, labels = _padded()
    engine = PerSampleEngine(model).attach()

    def hf(i):
        s = slice(None) if i is None else i
        return model(input_ids=ids[s], attention_mask=mask[s], labels=labels[s]).loss

    with pytest.raises(UnsupportedLayerError, match=r"LlamaForCausalLM was called with labels= padded with -100.*"
                                                    r"lightning_dpzero\.losses\.causal_lm_loss"):
        engine.check_layout(hf, 4)

    def helper(i):
        s = slice(None) if i is None else i
        return causal_lm_loss(model(input_ids=ids[s], attention_mask=mask[s]).logits, labels[s])

    assert engine.check_layout(helper, 4)
    engine.detach()


def test_hugging_face_attention_dropout_in_training_mode_is_not_taken_for_mixing():
    """BERT's attention calls F.dropout itself when in training mode (p = 0.1 here): the check's forwards switch
    Hugging Face's modules to eval, so this per-example model passes at the first and at later micro-batches."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(6)
    config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=24)
    model = transformers.BertModel(config, add_pooling_layer=False).train()
    ids = torch.randint(0, 32, (5, 8))
    engine = PerSampleEngine(model).attach()

    def run(i):
        s = slice(None) if i is None else i
        return model(input_ids=ids[s], position_ids=torch.arange(8).expand(5, 8)[s],
                     token_type_ids=torch.zeros_like(ids[s])).last_hidden_state[:, 0].pow(2).mean()

    assert engine.check_layout(run, 5) and engine.check_layout(run, 5, every_batch=True)
    assert all(m.training for m in model.modules())
    engine.detach()


def test_causal_lm_loss_is_the_mean_of_per_example_losses_and_hf_s_is_not():
    model = _llama(1).double().eval()
    ids, mask, labels = _padded(seed=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        alone = torch.stack([model(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1], labels=labels[i:i + 1]).loss
                             for i in range(4)])  # one example: HF's token mean is that example's own mean
        hf_batch = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    alone = alone.double()  # HF computes its loss in float32 at least
    torch.testing.assert_close(causal_lm_loss(logits, labels), alone.mean(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(causal_lm_loss(logits, labels, reduction="sum"), alone.sum(), rtol=1e-6, atol=1e-6)
    counts = (labels[:, 1:] != -100).sum(1).double()  # HF weights example i by its share of the tokens
    torch.testing.assert_close(hf_batch.double(), (alone * counts).sum() / counts.sum(), rtol=1e-6, atol=1e-6)
    assert abs(float(hf_batch) - float(alone.mean())) > 1e-4  # what the check refuses
    with pytest.raises(ValueError, match="logits"):
        causal_lm_loss(logits[0], labels)


# ---------------------------------------------------------------------------------------------- with the strategy
class Mixup(L.LightningModule):
    """A training_step that starts to mix examples at ``start`` (mixup after a warm-up); ``train_only``: a model
    that mixes only in training mode instead."""

    def __init__(self, start=3, train_only=False):
        super().__init__()
        self.net = TrainOnlyCentred() if train_only else nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        self.start, self.applied = start, 0

    def training_step(self, batch, _):
        x, y = batch
        if self.global_step + 1 >= self.start:  # global_step: the updates applied before this one
            perm = torch.randperm(len(x))
            x = 0.7 * x + 0.3 * x[perm]
        return F.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, *_):
        self.applied += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g)),
                          batch_size=4)


def _fit(module, steps=4, **kw):
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=0.0, max_grad_norm=1.0, seed=0, poisson_sampling=False,
                                   **kw)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    start = time.perf_counter()
    trainer.fit(module)
    return trainer, time.perf_counter() - start


def test_mixing_that_starts_later_is_refused_before_its_update_and_the_first_batch_check_misses_it():
    torch.manual_seed(3)
    module = Mixup(start=3)
    with pytest.raises(UnsupportedLayerError, match=r"(?s)layout check failed at micro-batch 3.*depends on other"):
        _fit(module)
    assert module.applied == 2  # updates 1 and 2 released, update 3 stopped before it was applied
    torch.manual_seed(3)
    late, seconds_first = _fit(Mixup(start=3), layout_check="first-batch")  # what the default adds
    assert late.global_step == 4
    _, seconds_every = _fit(Mixup(start=99))
    print(f"4 steps, 1 process: first-batch check {seconds_first:.2f} s, every-batch {seconds_every:.2f} s")


def test_train_mode_only_mixing_is_refused_by_the_strategy_before_any_update():
    torch.manual_seed(4)
    module = Mixup(start=99, train_only=True)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(UnsupportedLayerError, match="layout check failed at the first micro-batch"):
        _fit(module, steps=1)
    assert module.applied == 0 and all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_layout_check_settings():
    assert DPDeepSpeedStrategy().layout_check == "every-batch"
    assert DPDeepSpeedStrategy(layout_check=True).layout_check == "every-batch"
    assert DPDeepSpeedStrategy(layout_check="first-batch").layout_check == "first-batch"
    with pytest.warns(UserWarning, match="layout_check='off'"):
        assert DPDeepSpeedStrategy(layout_check="off").layout_check == "off"
    with pytest.warns(UserWarning, match="layout_check=False"):
        assert DPDeepSpeedStrategy(layout_check=False).layout_check == "off"
    with pytest.raises(ValueError, match=r"layout_check='sometimes' is not supported"):
        DPDeepSpeedStrategy(layout_check="sometimes")


class HFLabels(L.LightningModule):
    """The usual Hugging Face step: the model's own loss from ``labels=`` padded with -100."""

    def __init__(self):
        super().__init__()
        self.model = _llama(5)

    def training_step(self, batch, _):
        ids, mask = batch
        return self.model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        ids, mask, _ = _padded()
        return DataLoader(TensorDataset(ids.repeat(2, 1), mask.repeat(2, 1)), batch_size=4)


def test_the_strategy_refuses_hugging_face_s_padded_labels_loss_before_the_first_update():
    module = HFLabels()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(UnsupportedLayerError, match=r"(?s)at the first micro-batch.*labels= padded with -100.*"
                                                    r"causal_lm_loss\(outputs\.logits, labels\)"):
        _fit(module, steps=1)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())
