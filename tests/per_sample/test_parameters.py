"""Parameters used directly by a forward (class token, position embedding) and the run-time guard against
gradients that bypass per-example clipping (docs/design.md, I2 and I5)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpzero.per_sample import PerSampleEngine, UnsupportedLayerError
from models import TinyViT
from oracle import clipped_sum, per_example_grads


def _check(model, x, y, C=0.05, clipping="layer-wise", clipping_fn="abadi", groups=None, oracle_groups=None):
    ref = clipped_sum(model, per_example_grads(model, F.cross_entropy, x, y), C, clipping, clipping_fn,
                      groups=oracle_groups)
    engine = PerSampleEngine(model, max_grad_norm=C, clipping=clipping, clipping_fn=clipping_fn,
                             groups=groups).attach()
    with engine.micro_batch(batch_size=x.shape[0]):
        F.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-7, msg=n)
    return engine


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
@pytest.mark.parametrize("clipping_fn", ["abadi", "automatic"])
def test_class_token_and_position_embedding_match_the_oracle(clipping, clipping_fn):
    torch.manual_seed(0)
    model, x, y = TinyViT(), torch.randn(7, 1, 8, 8), torch.randint(0, 3, (7,))
    engine = _check(model, x, y, clipping=clipping, clipping_fn=clipping_fn)
    assert engine.stats["clipped"] > 0
    assert model.cls_token.grad.abs().sum() > 0 and model.pos_embed.grad.abs().sum() > 0
    assert isinstance(model.cls_token, nn.Parameter)  # the per-example views are gone after the forward


def test_group_wise_with_raw_parameters_in_their_own_group():
    torch.manual_seed(1)
    model, x, y = TinyViT(), torch.randn(5, 1, 8, 8), torch.randint(0, 3, (5,))
    _check(model, x, y, clipping="group-wise", groups=[["cls_token", "pos_embed"], ["*"]],
           oracle_groups=[["cls_token", "pos_embed"], ["patch.weight", "patch.bias", "ln.weight", "ln.bias",
                                                      "head.weight", "head.bias"]])


class TwiceTokens(nn.Module):
    """A module with a raw parameter, called twice in one forward (two sites of one parameter)."""

    def __init__(self, d=5):
        super().__init__()
        self.tok = nn.Parameter(torch.randn(1, 1, d))
        self.frozen = nn.Parameter(torch.randn(1, 1, d), requires_grad=False)

    def forward(self, h):
        return torch.cat((self.tok.expand(h.shape[0], -1, -1) * 2 + self.frozen, h), dim=1)


class TwiceNet(nn.Module):
    def __init__(self, d=5):
        super().__init__()
        self.lin = nn.Linear(3, d)
        self.tokens = TwiceTokens(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.tokens(self.tokens(self.lin(x)))
        return self.head(torch.sin(h)).mean(1)


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
def test_module_with_raw_parameter_called_twice_sums_its_sites(clipping):
    torch.manual_seed(2)
    model, x, y = TwiceNet(), torch.randn(6, 4, 3), torch.randint(0, 3, (6,))
    _check(model, x, y, clipping=clipping)
    assert model.tokens.frozen.grad is None


def test_real_huggingface_vit_matches_the_oracle():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=8, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=12, num_labels=3,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                 attn_implementation="eager")
    torch.manual_seed(3)
    model = transformers.ViTForImageClassification(cfg).train()
    with torch.no_grad():  # HF initialises both to zeros or near zero; make their gradients non-trivial
        model.vit.embeddings.cls_token.normal_()
        model.vit.embeddings.position_embeddings.normal_()

    class Logits(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(pixel_values=x).logits

    wrapped = Logits(model)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))
    _check(wrapped, x, y, C=0.2)
    assert model.vit.embeddings.cls_token.grad.abs().sum() > 0


class Scale(nn.Module):
    """A (d,) layer scale next to a layer, as ConvNeXt's: shared by every example until ``* self.gamma``."""

    def __init__(self, d=4):
        super().__init__()
        self.lin, self.head = nn.Linear(d, d), nn.Linear(d, 3)
        self.gamma = nn.Parameter(torch.rand(d) + 0.5)
        self.offset = nn.Parameter(torch.randn(2, d))  # added to each example's (T, d) activations

    def forward(self, x):  # (B, T, d)
        return self.head(self.lin(x) * self.gamma + self.offset.repeat(x.shape[1] // 2, 1)).mean(1)


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
def test_parameters_of_any_shape_broadcast_over_the_batch_match_the_oracle(clipping):
    torch.manual_seed(4)
    model, x, y = Scale(), torch.randn(3, 4, 4), torch.randint(0, 3, (3,))
    engine = _check(model, x, y, C=0.05, clipping=clipping)
    assert engine.stats["clipped"] > 0 and model.gamma.grad.abs().sum() > 0 and model.offset.grad.abs().sum() > 0
    assert isinstance(model.gamma, nn.Parameter)  # the shared values are gone after the forward


class Expanded(nn.Module):
    """A (d,) parameter expanded to (T, d) before the broadcast: when T == B the expansion looks like one."""

    def __init__(self, d=4):
        super().__init__()
        self.lin, self.p = nn.Linear(d, 3), nn.Parameter(torch.randn(d))

    def forward(self, x):  # (B, T, d)
        return self.lin(x + self.p.expand(x.shape[1], -1)).mean(1)


def test_a_shared_value_broadcast_along_a_dimension_that_equals_b_is_refused_by_the_layout_check():
    torch.manual_seed(5)
    model, y = Expanded(), torch.randint(0, 3, (3,))
    x = torch.randn(3, 4, 4)  # T != B: the addition broadcasts it over the batch
    _check(model, x, y)
    x = torch.randn(3, 3, 4)  # T == B: expand(T, d) would hand example t's copy to position t of every example
    engine = PerSampleEngine(model).attach()
    with pytest.raises(UnsupportedLayerError, match=r"Linear 'lin': row i of its input depends on other examples"):
        engine.check_layout(lambda i: F.cross_entropy(model(x if i is None else x[i]), y if i is None else y[i]), 3)


class Weight(nn.Module):
    """A (2, d) parameter used as a weight matrix, and a penalty on it added to the loss: neither is a broadcast
    over the batch."""

    def __init__(self, d=4):
        super().__init__()
        self.lin, self.w = nn.Linear(d, d), nn.Parameter(torch.randn(2, d))

    def forward(self, x):
        return F.linear(self.lin(x), self.w)

    def penalty(self):
        return self.w.pow(2).sum()


def test_a_shared_value_used_otherwise_than_broadcast_over_the_batch_is_refused(monkeypatch):
    # An in-process ZeRO-3 run earlier in the session leaves DeepSpeed's F.linear in place ("this will persist
    # unless manually reset"), an autograd Function whose forward runs without grad mode: there the use is not
    # refused and the parameter gets no gradient at all (not trained, nothing released). The refusal is checked
    # with torch's own F.linear.
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Patched

    monkeypatch.setattr(F, "linear", getattr(Patched, "linear_bk", F.linear))
    model = Weight()
    engine = PerSampleEngine(model).attach()
    with pytest.raises(UnsupportedLayerError, match=r"Weight '<root>': \['w'\].*linear combines it with a tensor "
                                                    r"that has a gradient without broadcasting it"):
        with engine.micro_batch(batch_size=3):
            model(torch.randn(3, 4))
    assert model.w.grad is None


def test_an_in_place_operation_on_a_shared_value_is_refused_before_it_runs():
    class InPlace(Scale):
        def forward(self, x):
            h = self.lin(x)
            h += self.gamma  # would be applied twice: once on the value, once with the per-example copies
            return self.head(h).mean(1)

    model = InPlace()
    engine = PerSampleEngine(model).attach()
    with pytest.raises(UnsupportedLayerError, match=r"InPlace '<root>'.*in-place operation \((__iadd__|add_)\).*x = x \+ p"):
        with engine.micro_batch(batch_size=3):
            model(torch.randn(3, 4, 4))


def test_raw_parameter_not_broadcast_over_the_batch_is_refused_at_the_first_batch():
    class Score(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.w = nn.Parameter(torch.randn(1, 4))  # first dimension 1, but used as a weight matrix

        def forward(self, x):
            return F.linear(self.lin(x), self.w).squeeze(-1)

    model = Score()
    engine = PerSampleEngine(model).attach()
    with engine.micro_batch(batch_size=1):  # one example: the view *is* w, exact whatever the forward does
        model(torch.randn(1, 4)).sum().backward()
    with pytest.raises(UnsupportedLayerError, match=r"Score '<root>' uses the parameters \['w'\].*changed"):
        with engine.micro_batch(batch_size=3):
            model(torch.randn(3, 4))


def test_view_broadcast_along_another_dimension_is_refused_even_when_shapes_agree():
    class Offset(nn.Module):  # (1, d) added to (B, T, d): its first dimension meets T, not B
        def __init__(self, d=4):
            super().__init__()
            self.lin = nn.Linear(d, d)
            self.offset = nn.Parameter(torch.randn(1, d))

        def forward(self, x):
            return self.lin(x) + self.offset

    model = Offset()
    engine = PerSampleEngine(model).attach()
    with pytest.raises(UnsupportedLayerError, match=r"\['offset'\].*other examples' outputs"):
        with engine.micro_batch(batch_size=3):  # T == B == 3: the output equals the original's
            model(torch.randn(3, 3, 4))


def test_view_of_another_example_is_refused():
    class LastRow(TinyViT):  # every example reads the last example's position embedding view
        def forward(self, x):
            h = self.patch(x).flatten(2).transpose(1, 2)
            return self.head(torch.tanh(self.ln(h + self.pos_embed[-1, 1:] + self.cls_token[-1]))).mean(1)

    model = LastRow()
    engine = PerSampleEngine(model).attach()
    with pytest.raises(UnsupportedLayerError, match="changed other examples' outputs"):
        with engine.micro_batch(batch_size=5):
            model(torch.randn(5, 1, 8, 8))


def test_forward_that_updates_its_input_in_place_is_not_run_on_it_twice():
    class AddInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.randn(1, 3, 4))

        def forward(self, h):
            h += self.pos
            return h

    torch.manual_seed(6)
    model = nn.Sequential(AddInPlace(), nn.Linear(4, 2))
    x = torch.randn(4, 3, 4)
    expected = model(x.clone())
    engine = PerSampleEngine(model).attach()
    with engine.micro_batch(batch_size=4):
        out = model(x.clone())
    torch.testing.assert_close(out, expected)


def test_forward_with_dropout_passes_the_once_check():
    class Drop(TinyViT):
        def forward(self, x):
            return super().forward(F.dropout(x, 0.5, self.training))

    torch.manual_seed(4)
    model = Drop()
    engine = PerSampleEngine(model, max_grad_norm=0.1).attach()
    with engine.micro_batch(batch_size=4):
        F.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.randint(0, 3, (4,))).backward()
    assert engine.hooks[-1].verified


# ---------------------------------------------------------------- the guard
class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return F.linear(self.lin(self.emb(x)), self.emb.weight)  # the embedding used outside its layer


def test_parameter_used_outside_its_layer_is_refused_not_silently_unclipped():
    model = TiedHead()
    engine = PerSampleEngine(model, max_grad_norm=1e-6).attach()
    with pytest.raises(UnsupportedLayerError, match=r"'emb.weight' received a gradient that did not pass"):
        with engine.micro_batch(batch_size=3):
            model(torch.randint(0, 10, (3, 5))).pow(2).mean().backward()


def test_forward_in_eval_mode_during_training_is_refused():
    model = TinyViT()
    engine = PerSampleEngine(model).attach()
    model.eval()
    with pytest.raises(UnsupportedLayerError, match="did not pass through per-example clipping"):
        with engine.micro_batch(batch_size=3):
            F.cross_entropy(model(torch.randn(3, 1, 8, 8)), torch.randint(0, 3, (3,))).backward()


def test_raw_parameter_used_outside_the_forward_is_refused():
    model = TinyViT()
    engine = PerSampleEngine(model).attach()
    with pytest.raises(UnsupportedLayerError, match="'cls_token' received a gradient"):
        with engine.micro_batch(batch_size=3):
            (model(torch.randn(3, 1, 8, 8)).sum() + model.cls_token.sum()).backward()


def test_detached_engine_leaves_plain_training_alone():
    model = TiedHead()
    engine = PerSampleEngine(model).attach()
    engine.detach()
    model(torch.randint(0, 10, (3, 5))).pow(2).mean().backward()  # no guard left behind
    assert model.emb.weight.grad is not None


class NanoPos(nn.Module):
    def __init__(self, T=4, d=3):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(10, d), nn.Embedding(T, d), nn.Linear(d, 3)

    def forward(self, idx):  # nanoGPT: (T,) position indices, no batch dimension, broadcast by the addition
        return self.head(self.tok(idx) + self.pos(torch.arange(idx.shape[1]))).mean(1)


@pytest.mark.parametrize("b", [3, 4])  # T == B (4): the indices' first dimension happens to equal the batch
def test_position_indices_without_a_batch_dimension_match_the_oracle(b):
    torch.manual_seed(6)
    model, x, y = NanoPos(), torch.randint(0, 10, (b, 4)), torch.randint(0, 3, (b,))
    engine = PerSampleEngine(model).attach()
    assert engine.check_layout(lambda i: F.cross_entropy(model(x if i is None else x[i]), y if i is None else y[i]), b)
    engine.detach()
    _check(model, x, y, C=0.05)
    assert model.pos.weight.grad.abs().sum() > 0
