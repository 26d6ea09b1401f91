"""Layer coverage (issue #3): every rule against the torch.func oracle, over random shapes (hypothesis).

Each property test draws a layer configuration, a batch (0 and 1 included), a clipping style (layer-wise,
all-layer), a clipping function (abadi, automatic), a threshold C (mostly clipped … never clipped) and which
norm the Linear rows use (the shape-based choice, or ghost / instantiated forced), then checks that the
engine's Σ_i clip(g_i) equals the float64 ``torch.func`` reference. A trainable layer in front of the tested
one checks its input gradient too.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from lightning_dpzero.per_sample import PerSampleEngine, UnsupportedLayerError
from lightning_dpzero.per_sample import linear as linear_mod
from oracle import clipped_sum, per_example_grads

# LAYER_EXAMPLES=500 for a deeper run; the default keeps the file well under a minute on 2 cores
EXAMPLES = int(os.environ.get("LAYER_EXAMPLES", "30"))
SETTINGS = settings(deadline=None, max_examples=EXAMPLES)
pytestmark = [pytest.mark.filterwarnings(f"ignore:{m}") for m in (
    "Support for mismatched key_padding_mask", "There is a performance drop", "Using padding='same'")]
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
INORM = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}


def loss_fn(out, y):
    """Mean over the batch of each example's 0.5·‖out_i − y_i‖² (the engine's ``loss_reduction="mean"``)."""
    return ((out.flatten(1) - y) ** 2).sum(1).mean() / 2


clip_st = st.fixed_dictionaries({
    "clipping": st.sampled_from(["layer-wise", "all-layer"]),
    "clipping_fn": st.sampled_from(["abadi", "automatic"]),
    "C": st.sampled_from([0.01, 1.0, 1e4]),
    "ghost": st.sampled_from([None, True, False]),  # None: the rule's own shape-based choice
    "B": st.sampled_from([0, 1, 2, 3]),
    "seed": st.integers(0, 2**16),
})


def check_oracle(model, x, clip, merge=None):
    """Engine vs. oracle for ``model(x)``. ``merge`` maps a module path onto the layer that owns it (the
    attention's ``out_proj``) for the oracle's layer-wise groups."""
    B = x.shape[0]
    with torch.no_grad():  # output size from one example (PyTorch's InstanceNorm fails on an empty batch)
        n_out = model(torch.zeros(1, *x.shape[1:], dtype=x.dtype)).flatten(1).shape[1]
    y = torch.randn(B, n_out, generator=torch.Generator().manual_seed(clip["seed"]))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = None
    if clip["clipping"] == "layer-wise":
        by: dict[str, list[str]] = {}
        for n in names:
            mod = n.rsplit(".", 1)[0]
            by.setdefault((merge or {}).get(mod, mod), []).append(n)
        groups = list(by.values())
    if B:
        grads = per_example_grads(model, loss_fn, x, y)
        ref = clipped_sum(model, grads, clip["C"], clip["clipping"], clip["clipping_fn"], groups=groups)
    else:
        ref = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    engine = PerSampleEngine(model, max_grad_norm=clip["C"], clipping=clip["clipping"],
                             clipping_fn=clip["clipping_fn"]).attach()
    hooks = [(h.name, type(h.rule).__name__) for h in engine.hooks]
    force = clip["ghost"]
    patch = mock.patch.object(linear_mod, "use_ghost", lambda T, d, p: force) if force is not None else nullcontext()
    try:
        with patch, engine.micro_batch(batch_size=B):
            torch.nan_to_num(loss_fn(model(x), y)).backward()  # B = 0: the mean over no examples is NaN
    finally:
        engine.detach()
    # float32 against float64: rounding is relative to the largest gradient entries (a gradient that is zero
    # in exact arithmetic, e.g. a bias that shifts every attention score alike, is float32 noise, which
    # automatic clipping scales by C/γ like everything else)
    tol = 1e-5 * (1.0 + max(float(r.abs().max()) for r in ref.values() if r.numel()))
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-3, atol=tol, msg=lambda m: f"{n}: {m}")
    return hooks


# ---------------------------------------------------------------------------------------------- Conv
@st.composite
def conv_cases(draw):
    n = draw(st.sampled_from([1, 2, 3]))
    G = draw(st.sampled_from([1, 1, 2, 3]))
    cin, cout = G * draw(st.integers(1, 2)), G * draw(st.integers(1, 2))
    k = tuple(draw(st.integers(1, 3)) for _ in range(n))
    dil = tuple(draw(st.integers(1, 2)) for _ in range(n))
    kind = draw(st.sampled_from(["int", "tuple", "valid", "same"]))
    stride = 1 if kind == "same" else draw(st.sampled_from([1, 2, (1, 2, 1)[:n] if n > 1 else 2]))
    pad = {"int": draw(st.integers(0, 1)), "tuple": tuple(draw(st.integers(0, 2)) for _ in range(n)),
           "valid": "valid", "same": "same"}[kind]
    mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"]))
    pads = [(pad, pad)] * n if isinstance(pad, int) else list(zip(pad, pad)) if isinstance(pad, tuple) else (
        [(0, 0)] * n if pad == "valid" else [(d * (kk - 1) // 2, d * (kk - 1) - d * (kk - 1) // 2) for d, kk in zip(dil, k)])
    hi = {1: 12, 2: 6, 3: 4}[n]
    size = []
    for (l, r), kk, d in zip(pads, k, dil):
        lo = max(1, d * (kk - 1) + 1 - l - r, l + 1, r + 1)  # one output; reflect needs padding < size
        size.append(draw(st.integers(lo, max(lo, hi))))
    bias = draw(st.booleans())
    return dict(n=n, cin=cin, cout=cout, k=k, stride=stride, pad=pad, dil=dil, G=G, mode=mode, size=size, bias=bias)


class PreThen(nn.Module):
    """A 1×1 convolution (trainable, checks the tested layer's input gradient), tanh, then ``layer``."""

    def __init__(self, n, c, layer):
        super().__init__()
        self.pre, self.layer = CONV[n](c, c, 1), layer

    def forward(self, x):
        return self.layer(torch.tanh(self.pre(x)))


@settings(deadline=None, max_examples=2 * EXAMPLES)
@given(case=conv_cases(), clip=clip_st)
def test_conv_matches_oracle(case, clip):
    torch.manual_seed(clip["seed"])
    c = case
    conv = CONV[c["n"]](c["cin"], c["cout"], c["k"], c["stride"], c["pad"], c["dil"], c["G"], c["bias"], c["mode"])
    model = PreThen(c["n"], c["cin"], conv)
    check_oracle(model, torch.randn(clip["B"], c["cin"], *c["size"]), clip)


def test_conv_refuses_unbatched_input():
    conv = nn.Conv1d(2, 3, 3)
    engine = PerSampleEngine(conv).attach()
    with engine.micro_batch(batch_size=2), pytest.raises(UnsupportedLayerError, match="batched input"):
        conv(torch.randn(2, 8))


# ---------------------------------------------------------------------------------------------- HF Conv1D
class Conv1D(nn.Module):
    """Stand-in for ``transformers.pytorch_utils.Conv1D`` (transformers is not a dependency)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


Conv1D.__module__ = "transformers.pytorch_utils"


class GPT2MLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(h, d), Conv1D(d, h)

    def forward(self, x):
        return self.c_proj(torch.tanh(self.c_fc(x)))


@SETTINGS
@given(d=st.integers(1, 6), h=st.integers(1, 8), T=st.sampled_from([None, 1, 2, 5, 9]), clip=clip_st)
def test_hf_conv1d_matches_oracle(d, h, T, clip):
    torch.manual_seed(clip["seed"])
    shape = (clip["B"], d) if T is None else (clip["B"], T, d)
    hooks = check_oracle(GPT2MLP(d, h), torch.randn(shape), clip)
    assert [rule for _, rule in hooks] == ["HFConv1DRule"] * 2


def test_hf_conv1d_found_by_name_only():
    from lightning_dpzero.per_sample.registry import find_rule

    assert type(find_rule(Conv1D(3, 2))).__name__ == "HFConv1DRule"
    Other = type("Conv1D", (nn.Module,), {"__module__": "mypackage.layers"})
    assert find_rule(Other()) is None
    bad = Conv1D(3, 2)
    bad.nf = 5
    with pytest.raises(UnsupportedLayerError, match="nx, nf"):
        PerSampleEngine(bad).attach()


# ---------------------------------------------------------------------------------------------- Linear, Embedding, LayerNorm, GroupNorm
class TokenNet(nn.Module):
    def __init__(self, V, d, h, groups):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.lin = nn.Linear(d, h)
        self.ln = nn.LayerNorm(h)
        self.gn = nn.GroupNorm(groups, h)

    def forward(self, x):
        z = self.ln(torch.tanh(self.lin(self.emb(x))))  # (B, T, h)
        return self.gn(z.transpose(1, 2))


@SETTINGS
@given(V=st.integers(2, 6), d=st.integers(1, 5), gh=st.sampled_from([(1, 3), (2, 6), (3, 9)]),
       T=st.integers(1, 8), clip=clip_st)
def test_linear_embedding_layernorm_groupnorm_match_oracle(V, d, gh, T, clip):
    # (normalising 2 values gives ±1 whatever the input: the input gradient would be float32 noise)
    torch.manual_seed(clip["seed"])
    check_oracle(TokenNet(V, d, gh[1], gh[0]), torch.randint(0, V, (clip["B"], T)), clip)


# ---------------------------------------------------------------------------------------------- InstanceNorm, RMSNorm
@SETTINGS
@given(n=st.sampled_from([1, 2, 3]), C=st.integers(1, 3), size=st.lists(st.integers(1, 4), min_size=3, max_size=3),
       eps=st.sampled_from([1e-5, 0.1]), clip=clip_st)
def test_instance_norm_matches_oracle(n, C, size, eps, clip):
    size = size[:n]
    if math.prod(size) < 3:
        size[0] = 3  # > 1 element in training; 2 would make x̂ = ±1, whose input gradient is float32 noise
    torch.manual_seed(clip["seed"])
    norm = INORM[n](C, eps=eps, affine=True)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    check_oracle(PreThen(n, C, norm), torch.randn(clip["B"], C, *size), clip)


def test_instance_norm_with_running_stats_is_refused():
    with pytest.raises(UnsupportedLayerError, match="track_running_stats=True.*not be differentially private"):
        PerSampleEngine(nn.InstanceNorm2d(3, affine=True, track_running_stats=True)).attach()


class RMSNet(nn.Module):
    def __init__(self, d, shape, eps, affine):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.RMSNorm(shape, eps=eps, elementwise_affine=affine)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.norm(self.lin(x)))


@SETTINGS
@given(d=st.integers(2, 6), T=st.integers(1, 5), two_dims=st.booleans(), eps=st.sampled_from([None, 1e-3]),
       affine=st.booleans(), clip=clip_st)
def test_rmsnorm_matches_oracle(d, T, two_dims, eps, affine, clip):
    torch.manual_seed(clip["seed"])
    model = RMSNet(d, (T, d) if two_dims else (d,), eps, affine)
    if affine:
        with torch.no_grad():
            model.norm.weight.normal_()
    check_oracle(model, torch.randn(clip["B"], T, d), clip)


# ---------------------------------------------------------------------------------------------- subclasses
class MyLinear(nn.Linear):
    pass


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class PaddedConv(nn.Conv2d):
    def _conv_forward(self, x, weight, bias):
        return super()._conv_forward(x, weight, bias) + 1


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
def test_subclass_keeping_forward_is_accepted(clipping):
    from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

    torch.manual_seed(0)
    model = nn.Sequential(MyLinear(3, 4), nn.Tanh(), NonDynamicallyQuantizableLinear(4, 2))
    clip = dict(clipping=clipping, clipping_fn="abadi", C=0.05, ghost=None, B=4, seed=1)
    assert [name for name, _ in check_oracle(model, torch.randn(4, 3), clip)] == ["0", "2"]


@pytest.mark.parametrize("layer, method", [(ScaledLinear(3, 2), "forward"), (PaddedConv(1, 2, 3), "_conv_forward")])
def test_subclass_overriding_forward_is_refused(layer, method):
    with pytest.raises(UnsupportedLayerError, match=f"{type(layer).__name__} subclasses .* overrides {method}"):
        PerSampleEngine(nn.Sequential(layer)).attach()


def test_unknown_parameter_on_a_supported_layer_is_named():
    lin = MyLinear(3, 2)
    lin.scale = nn.Parameter(torch.ones(2))
    with pytest.raises(UnsupportedLayerError, match=r"'scale' of MyLinear.*does not know \(scale\)"):
        PerSampleEngine(lin).attach()
