"""The generic rule (per_sample/generic.py): any module with trainable parameters of its own and no dedicated
rule is clipped exactly, after proving at its first call that it is per-example; what it cannot clip is
refused before any gradient is returned, naming the module and the fix. HuggingFace's RMSNorm family by
class name (per_sample/hf_norm.py), and refusal messages of one line per module class (docs/design.md, I5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpzero.per_sample import PerSampleEngine, UnsupportedLayerError
from dispatch import AtenOps
from oracle import clipped_sum, per_example_grads


def loss_fn(out, y):
    return ((out.flatten(1) - y) ** 2).sum(1).mean() / 2


def _check(model, x, C=0.1, clipping="layer-wise"):
    """Engine vs torch.func oracle on ``model(x)``; returns the rule class names of the engine's sites."""
    y = torch.randn(x.shape[0], model(x).flatten(1).shape[1], generator=torch.Generator().manual_seed(0))
    ref = clipped_sum(model, per_example_grads(model, loss_fn, x, y), C, clipping)
    model.zero_grad(set_to_none=True)
    engine = PerSampleEngine(model, max_grad_norm=C, clipping=clipping).attach()
    rules = [(h.name, type(h.rule).__name__) for h in engine.hooks]
    try:
        with engine.micro_batch(batch_size=x.shape[0]):
            loss_fn(model(x), y).backward()
    finally:
        engine.detach()
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-7, msg=lambda m: f"{n}: {m}")
    assert engine.stats["clipped"] > 0
    return rules


class Gated(nn.Module):
    """A custom layer: two inputs (one by keyword), an option, a mask shared by every example, a tuple out."""

    def __init__(self, d=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) * 0.5)
        self.g = nn.Parameter(torch.randn(d))

    def forward(self, x, gate, mask=None, scale=2.0):
        h = torch.tanh(x @ self.w) * torch.sigmoid(gate * self.g) * scale
        return (h if mask is None else h * mask), h.sum(-1)


class GatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.layer, self.head = nn.Linear(4, 4), Gated(), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        out, total = self.layer(h, gate=h * 0.5, mask=(torch.arange(4) % 2).float()[None, None], scale=1.5)
        return self.head(out + total[..., None])


class ScaleNorm(nn.Module):
    """An RMSNorm variant of a user's (1 + w): no dedicated rule, the generic one."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d) * 0.3)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
def test_custom_layers_match_the_oracle(clipping):
    torch.manual_seed(0)
    rules = _check(GatedNet(), torch.randn(5, 3, 4), clipping=clipping)
    assert ("layer", "InstantiatedGradsRule") in rules
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 6), ScaleNorm(6), nn.Linear(6, 2))
    assert ("1", "InstantiatedGradsRule") in _check(model, torch.randn(4, 7, 3), clipping=clipping)


class Temperature(nn.Module):
    """A learned scalar of shape (1,): a scale, not a batch-first tensor (no per-example view of it broadcasts)."""

    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.ones(1) * 1.3)

    def forward(self, x):
        return x / self.t


class ZeroDimTemperature(Temperature):
    """A learned scalar of shape (): its per-example gradients are (B,) (their clipped sum failed before)."""

    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.3))


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
@pytest.mark.parametrize("layer", [nn.PReLU, Temperature, ZeroDimTemperature], ids=["prelu", "scalar", "zero_dim"])
def test_a_scalar_parameter_of_shape_1_is_clipped_by_the_generic_rule(clipping, layer):
    """nn.PReLU()'s weight and a learned temperature, (1,) or (): the generic rule clips them (per-example views
    of shape (B,) would broadcast over the features, not the batch, and were refused)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 6), layer(), nn.Linear(6, 2))
    assert ("1", "InstantiatedGradsRule") in _check(model, torch.randn(5, 4, 3), clipping=clipping)


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(3, 4), ScaleNorm(4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.norm(self.lin(x)))))


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
def test_a_layer_called_twice_sums_its_sites(clipping):
    torch.manual_seed(2)
    _check(Twice(), torch.randn(4, 5, 3), clipping=clipping)


@pytest.mark.parametrize("batch", [0, 1])
def test_empty_and_single_example_batches(batch):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 6), ScaleNorm(6), nn.Linear(6, 2))
    engine = PerSampleEngine(model, max_grad_norm=0.1).attach()
    x = torch.randn(batch, 3)
    with engine.micro_batch(batch_size=batch):
        torch.nan_to_num(model(x).pow(2).sum(1).mean()).backward()
    assert model[1].weight.grad.shape == (6,)
    assert not engine.hooks[-1].verified  # proven only at a call of two or more examples


# ---------------------------------------------------------------------------------------------- what it refuses
class Centred(nn.Module):  # mixes examples: statistics over the batch
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (x - x.mean(0)) * self.w


class Noisy(nn.Module):  # draws random numbers per call
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return F.dropout(x, 0.5, self.training) * self.w


class Counting(nn.Module):  # keeps state in a buffer
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return x * self.w


class InPlace(nn.Module):  # writes into its input
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x.mul_(2) * self.w


class BatchGradient(nn.Module):
    """Its values are per-example (the batch terms cancel) but its gradient is not: only the gradient check sees it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        extra = self.w * x.mean(0)
        return self.w * x + extra - extra.detach()


@pytest.mark.parametrize("layer, match", [
    (Centred(), "differs from its output in the batch: the forward mixes examples"),
    (Noisy(), "draws random numbers"),
    (Counting(), "changes its buffer 'calls'"),
    (InPlace(), r"changes its input 0 \(in place\)"),
    (BatchGradient(), "per-example gradients of 'w' do not sum to its batched gradient"),
])
def test_what_the_generic_rule_cannot_clip_is_refused_before_any_gradient(layer, match):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 4), layer, nn.Linear(4, 2))
    engine = PerSampleEngine(model).attach()
    with pytest.raises(UnsupportedLayerError, match=rf"{type(layer).__name__} '1' has no dedicated.*{match}.*Fix"):
        with engine.micro_batch(batch_size=3):
            (model(torch.randn(3, 4)) * torch.randn(3, 2)).sum().backward()
    assert model[1].w.grad is None  # the call returned no gradient (the error stops training before its step)


def test_own_parameters_next_to_trainable_children_are_traced_to_their_broadcast():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.alpha = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x + self.alpha * self.inner(x)

    rules = {type(h.rule).__name__ for h in PerSampleEngine(Residual()).attach().hooks}
    assert rules == {"LinearRule", "BroadcastParameterRule"}  # alpha: shared until ``* self.inner(x)``
    frozen = Residual()
    frozen.inner.requires_grad_(False)  # no trainable child: the generic rule covers alpha
    assert type(PerSampleEngine(frozen).attach().hooks[0].rule).__name__ == "InstantiatedGradsRule"


class GainLinear(nn.Linear):
    """A subclass of a layer with a rule, with a parameter the rule does not know and a trainable child."""

    def __init__(self):
        super().__init__(8, 8)
        self.gain, self.inner = nn.Parameter(torch.ones(8)), nn.Linear(8, 8)

    def forward(self, x):
        return super().forward(self.inner(x)) * self.gain


def test_own_parameters_of_a_layer_subclass_next_to_trainable_children_are_refused_with_what_to_do():
    with pytest.raises(UnsupportedLayerError, match=r"'gain' of GainLinear '<root>'.*child modules with trainable "
                                                    r"parameters \(inner\).*Fix: move these parameters into a small "
                                                    r"module of their own.*register a rule.*or freeze"):
        PerSampleEngine(GainLinear()).attach()


def test_refusals_are_one_line_per_module_class_for_a_deep_model():
    model = nn.Sequential(*[GainLinear() for _ in range(32)], *[nn.BatchNorm1d(8) for _ in range(32)])
    with pytest.raises(UnsupportedLayerError) as err:
        PerSampleEngine(model).attach()
    msg = str(err.value)
    assert len(msg.splitlines()) == 2 and "BatchNorm1d '32', '33', '34' and 29 more" in msg and len(msg) < 600
    model = nn.Sequential(*[GainLinear() for _ in range(32)])
    with pytest.raises(UnsupportedLayerError) as err:
        PerSampleEngine(model).attach()
    msg = str(err.value)
    assert len(msg.splitlines()) == 2 and len(msg) < 1400, msg
    assert "of GainLinear '0' and 31 more GainLinear modules ('1', '2', '3' and 28 more)" in msg


# ---------------------------------------------------------------------------------------------- HF RMSNorm by name
def _hf_named(name, forward):
    """A class called ``name`` in a module under ``transformers`` (the package is not needed)."""
    cls = type(name, (nn.Module,), {"forward": forward})
    cls.__module__ = "transformers.models.fake.modeling_fake"

    def init(self, d):
        nn.Module.__init__(self)
        self.weight = nn.Parameter(torch.randn(d) * 0.3 + 1)
        self.variance_epsilon = 1e-6

    cls.__init__ = init
    return cls


def _rms(self, x):
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(x.dtype)


def _gemma(self, x):
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (h * (1.0 + self.weight.float())).type_as(x)


@pytest.mark.parametrize("name, forward", [("LlamaRMSNorm", _rms), ("GemmaRMSNorm", _gemma)])
def test_hf_rmsnorm_backward_normalises_once(name, forward):
    # fp32: one normalisation in the backward (the closed form), not the class's forward again under autograd
    # and a third time for the per-example gradients
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 6), _hf_named(name, forward)(6), nn.Linear(6, 2))
    engine = PerSampleEngine(model, max_grad_norm=0.1).attach()
    with engine.micro_batch(batch_size=4):
        loss = model(torch.randn(4, 5, 3)).pow(2).mean()
        with AtenOps() as ops:
            loss.backward()
    # one rsqrt normalises; each clipping group's coefficients take one more (clipping.clip_coefficients_sq)
    assert ops.count("rsqrt") == 1 + len(engine.groups)


def _centred(self, x):  # a same-named class that computes something else
    x = x - x.mean(-1, keepdim=True)
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


@pytest.mark.parametrize("name, forward, rule", [
    ("LlamaRMSNorm", _rms, "HFRMSNormRule"), ("GemmaRMSNorm", _gemma, "HFRMSNormRule"),
    ("T5LayerNorm", _rms, "HFRMSNormRule"), ("LlamaRMSNorm", _centred, "InstantiatedGradsRule"),
    ("SomeOtherRMSNorm", _rms, "InstantiatedGradsRule"),
])
def test_hf_rmsnorm_family_by_name_or_the_generic_rule(name, forward, rule):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 6), _hf_named(name, forward)(6), nn.Linear(6, 2))
    assert ("1", rule) in _check(model, torch.randn(4, 5, 3))
