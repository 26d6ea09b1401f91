"""Parametrized layers (per_sample/parametrized.py): the per-example gradients of a parametrization's parameters
through its vjp match a float64 per-example loop, for torch.nn.utils.parametrize (weight_norm, spectral_norm,
orthogonal, chained and user parametrizations) and the hook-based weight_norm / spectral_norm, in every clipping
style; what cannot be formed is refused, with the true reason, before any gradient is applied."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from lightning_dpzero.per_sample import PerSampleEngine, UnsupportedLayerError
from oracle import backward, clipped_sum, layer_groups

P = torch.nn.utils.parametrizations
B, C = 5, 0.3


class Scaled(nn.Module):
    """A user parametrization with a trainable parameter of its own: W = s · X."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.7))

    def forward(self, x):
        return self.s * x


class Sum2(nn.Module):
    """A parametrization of two originals (its right_inverse splits the tensor): W = A + B/2."""

    def forward(self, a, b):
        return a + 0.5 * b

    def right_inverse(self, w):
        return w, torch.zeros_like(w)


def _layers(kind: str) -> nn.Module:
    """Conv1d → flatten → Linear → tanh → Linear, with the parametrization ``kind`` on some of them."""
    torch.manual_seed(0)
    conv, fc, head = nn.Conv1d(3, 4, 3, padding=1), nn.Linear(20, 6), nn.Linear(6, 2)
    if kind == "weight_norm":  # dim 2 as Wav2Vec2's positional convolution
        conv, fc = P.weight_norm(conv, dim=2), P.weight_norm(fc)
    elif kind == "spectral_norm":
        fc = P.spectral_norm(fc, n_power_iterations=2)
    elif kind == "orthogonal":
        fc = nn.Linear(20, 20)
        head = nn.Linear(20, 2)
        fc = P.orthogonal(fc)
    elif kind == "chained":  # two parametrizations on one weight, one with its own parameter, and the bias
        fc = P.weight_norm(fc)
        parametrize.register_parametrization(fc, "weight", Scaled())
        parametrize.register_parametrization(head, "bias", Scaled())
    elif kind == "two_originals":
        parametrize.register_parametrization(fc, "weight", Sum2())
    elif kind == "hook_weight_norm":
        conv = torch.nn.utils.weight_norm(conv, dim=2)
    elif kind == "hook_spectral_norm":
        fc = torch.nn.utils.spectral_norm(fc)
    return nn.Sequential(conv, nn.Flatten(), fc, nn.Tanh(), head)


KINDS = ["weight_norm", "spectral_norm", "orthogonal", "chained", "two_originals", "hook_weight_norm",
         "hook_spectral_norm"]


def _reference(kind, trained, x, y, clipping):
    """Σ_i clip(g_i) from one float64 backward per example on a copy built alike (the hook-based weight_norm's
    modules cannot be deep-copied) holding ``trained``'s state in eval mode: spectral_norm's u and v as the
    training forward left them."""
    ref = _layers(kind).double()
    ref.load_state_dict(trained.state_dict())
    frozen = {n for n, p in trained.named_parameters() if not p.requires_grad}
    for n, p in ref.named_parameters():
        p.requires_grad_(n not in frozen)
    ref.eval()
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    per = {n: [] for n, _ in named}
    for i in range(len(x)):
        grads = torch.autograd.grad(F.cross_entropy(ref(x[i:i + 1].double()), y[i:i + 1]), [p for _, p in named])
        for (n, _), g in zip(named, grads):
            per[n].append(g)
    grads = {n: torch.stack(v) for n, v in per.items()}
    return clipped_sum(ref, grads, C, clipping, groups=layer_groups(list(grads)) if clipping == "layer-wise" else None)


def _engine_grads(model, x, y, clipping, mode="book-keeping"):
    engine = PerSampleEngine(model, max_grad_norm=C, clipping=clipping, clipping_mode=mode).attach()
    try:
        with engine.micro_batch(batch_size=len(x)):
            backward(engine, F.cross_entropy(model(x), y))
    finally:
        engine.detach()
    assert engine.stats["clipped"] > 0
    return engine


@pytest.mark.parametrize("clipping,mode", [("all-layer", "book-keeping"), ("all-layer", "two-pass"),
                                           ("layer-wise", "book-keeping")])
@pytest.mark.parametrize("kind", KINDS)
def test_the_parametrizations_parameters_match_the_float64_reference(kind, clipping, mode):
    model = _layers(kind).train()
    x, y = torch.randn(B, 3, 5), torch.randint(0, 2, (B,))
    engine = _engine_grads(model, x, y, clipping, mode)
    ref = _reference(kind, model, x, y, clipping)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("original" in n or n.endswith(("_g", "_v", "_orig")) for n in names)
    assert set(ref) == set(names)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=0, atol=1e-6, msg=lambda m: f"{kind} {n}: {m}")
    # layer-wise: one group per layer, the parametrization's parameters with the layer's bias
    if clipping == "layer-wise":
        assert len(engine.groups) == 3


def test_a_parametrized_layer_called_twice_sums_its_sites_per_example():
    """A weight-normed Linear applied twice in the forward (shared weights): each example's gradient of g and v
    is the sum over both calls before its norm."""
    torch.manual_seed(1)
    model = nn.Sequential(P.weight_norm(nn.Linear(4, 4)), nn.Tanh())

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.head = model, nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.block(self.block(x)))

    net = Twice().train()
    x, y = torch.randn(B, 4), torch.randint(0, 2, (B,))
    _engine_grads(net, x, y, "all-layer")
    ref = net.double()
    named = [(n, p) for n, p in ref.named_parameters()]
    per = {n: [] for n, _ in named}
    for i in range(B):
        for (n, _), g in zip(named, torch.autograd.grad(F.cross_entropy(ref(x[i:i + 1].double()), y[i:i + 1]),
                                                        [p for _, p in named])):
            per[n].append(g)
    want = clipped_sum(ref, {n: torch.stack(v) for n, v in per.items()}, C)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(p.grad.double(), want[n], rtol=0, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_frozen_originals_get_nothing_and_the_others_train():
    """weight_norm with g frozen: only v (and the bias) receive clipped gradients, the norm taken of those alone."""
    model = _layers("weight_norm").train()
    for m in (model[0], model[2]):
        m.parametrizations.weight.original0.requires_grad_(False)
    x, y = torch.randn(B, 3, 5), torch.randint(0, 2, (B,))
    _engine_grads(model, x, y, "all-layer")
    ref = _reference("weight_norm", model, x, y, "all-layer")
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None and n not in ref
            continue
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=0, atol=1e-6)


def test_spectral_norm_runs_its_power_iteration_once_per_training_forward_as_without_dp():
    """The power iteration reads the weight only (no example): DP training updates u and v exactly as plain
    training does, once per forward, and the backward's recomputation updates nothing."""
    dp, plain = _layers("spectral_norm").train(), _layers("spectral_norm").train()
    x, y = torch.randn(B, 3, 5), torch.randint(0, 2, (B,))
    _engine_grads(dp, x, y, "all-layer")
    F.cross_entropy(plain(x), y).backward()
    u = "2.parametrizations.weight.0._u"
    assert not torch.equal(dp.state_dict()[u], _layers("spectral_norm").state_dict()[u])  # it did run
    for k, v in plain.state_dict().items():
        if k.endswith(("_u", "_v")):
            torch.testing.assert_close(dp.state_dict()[k], v, rtol=0, atol=0)


class Jitter(nn.Module):
    """A parametrization that draws random numbers: its recomputation in backward gives another weight."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


def test_a_parametrization_that_does_not_recompute_the_same_weight_is_refused_before_any_gradient():
    fc = nn.Linear(4, 2)
    parametrize.register_parametrization(fc, "weight", Jitter())
    x = torch.randn(B, 4)
    engine = PerSampleEngine(fc, max_grad_norm=C).attach()
    with pytest.raises(UnsupportedLayerError, match="gave another tensor when recomputed in backward"):
        with engine.micro_batch(batch_size=B):
            fc(x).sum().backward()
    engine.detach()
    assert fc.parametrizations.weight.original.grad is None and fc.bias.grad is None


class Affine(nn.Module):
    """A custom layer without a dedicated rule."""

    def __init__(self):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return x @ self.weight.t() + self.bias


@pytest.mark.parametrize("weight_norm", [P.weight_norm, torch.nn.utils.weight_norm], ids=["parametrize", "hook"])
def test_a_parametrized_layer_without_a_dedicated_rule_is_refused_with_the_true_reason(weight_norm):
    """One line per layer class, naming its parameters, the parametrization and the fix; before this change the
    hook-based weight_norm on such a layer trained g and v with zero gradients, and the parametrize one was
    refused with a false message about the batch dimension."""
    model = nn.Sequential(weight_norm(Affine(), dim=0), nn.Linear(3, 2), weight_norm(Affine(), dim=0))
    with pytest.raises(UnsupportedLayerError) as err:
        PerSampleEngine(model, max_grad_norm=C).attach()
    msg = str(err.value)
    assert len(msg.splitlines()) == 2, msg
    assert "'0.bias'" in msg and ("'0.parametrizations.weight.original1'" in msg or "'0.weight_v'" in msg)
    assert "computed by a parametrization" in msg and "Affine has none" in msg and "1 more" in msg
    assert "batch" not in msg
    assert all(m.__dict__.get("forward") is None for m in model.modules())  # detached: nothing left attached


def test_an_empty_micro_batch_gives_every_source_zeros():
    model = _layers("weight_norm").train()
    engine = PerSampleEngine(model, max_grad_norm=C).attach()
    engine.start_micro_batch(0, stand_in_rows=1)
    F.cross_entropy(model(torch.randn(1, 3, 5)), torch.tensor([1])).backward()
    engine.finalize()
    engine.detach()
    for n, p in model.named_parameters():
        assert p.grad is not None and not p.grad.any(), n
