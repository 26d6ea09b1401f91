"""Layer coverage (issue #3): every rule against the torch.func oracle, over random shapes (hypothesis).

Each property test draws a layer configuration, a batch (0 and 1 included), a clipping style (layer-wise,
all-layer), a clipping function (abadi, automatic), a threshold C (mostly clipped … never clipped) and which
path the Linear-like rules take (their cost-model choice, or ghost, instantiated or instantiate-and-reuse
forced), then checks that the engine's Σ_i clip(g_i) equals the float64 ``torch.func`` reference. A trainable layer in front of the tested
one checks its input gradient too.
"""

from __future__ import annotations

import math
import os
import weakref
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from lightning_dpzero.per_sample import PerSampleEngine, UnsupportedLayerError
from lightning_dpzero.per_sample import conv as conv_mod
from lightning_dpzero.per_sample import paths as paths_mod
from lightning_dpzero.per_sample import registry
from lightning_dpzero.per_sample.base import Site
from dispatch import AtenOps
from oracle import backward, clipped_sum, clipping_mode, per_example_grads

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
    # all-layer's clipping_mode (layer-wise keeps nothing across layers: always one pass)
    "mode": st.sampled_from(["book-keeping", "two-pass"]),
    "C": st.sampled_from([0.01, 1.0, 1e4]),
    # which path the Linear-like rules take (None: their own cost-model choice); "reuse" applies where the
    # site completes its group (layer-wise), elsewhere the rule falls back to its own ghost/instantiate choice
    "path": st.sampled_from([None, "ghost", "inst", "reuse"]),
    "B": st.sampled_from([0, 1, 2, 3]),
    "seed": st.integers(0, 2**16),
})


@contextmanager
def force_path(path):
    """Force the Linear-like rules' path: ``"ghost"``/``"inst"`` (norm, then the clipped matmul) or
    ``"reuse"`` (instantiate and reuse, where the site completes its group); ``None``: the cost model."""
    if path is None:
        yield
        return
    ghost = {"ghost": lambda *a: True, "inst": lambda *a: False, "reuse": paths_mod.use_ghost}[path]
    with mock.patch.object(paths_mod, "use_ghost", ghost), \
            mock.patch.object(paths_mod, "use_reuse", lambda *a, **k: path == "reuse"):
        yield


def check_oracle(model, x, clip, merge=None, engines=None):
    """Engine vs. oracle for ``model(x)``. ``merge`` maps a module path onto the layer that owns it (the
    attention's ``out_proj``) for the oracle's layer-wise groups; the engine is appended to ``engines``."""
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
    float32_error = 0.0
    if B:
        grads = per_example_grads(model, loss_fn, x, y)
        ref = clipped_sum(model, grads, clip["C"], clip["clipping"], clip["clipping_fn"], groups=groups)
        if x.dtype == torch.float32:
            # the same oracle in float32: how far float32 arithmetic itself lands from float64 on this input
            # (an RMSNorm over 2 values of RMS 0.02 amplifies rounding ~50×; plain autograd is then as far off)
            ref32 = clipped_sum(model, per_example_grads(model, loss_fn, x, y, torch.float32), clip["C"],
                                clip["clipping"], clip["clipping_fn"], groups=groups)
            float32_error = max(float((ref32[n].double() - ref[n]).abs().max()) for n in ref if ref[n].numel())
    else:
        ref = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    engine = PerSampleEngine(model, max_grad_norm=clip["C"], clipping=clip["clipping"],
                             clipping_fn=clip["clipping_fn"], clipping_mode=clipping_mode(clip)).attach()
    hooks = [(h.name, type(h.rule).__name__) for h in engine.hooks]
    if engines is not None:
        engines.append(engine)
    try:
        with force_path(clip["path"]), engine.micro_batch(batch_size=B):
            backward(engine, torch.nan_to_num(loss_fn(model(x), y)))  # B = 0: the mean over no examples is NaN
    finally:
        engine.detach()
    # float32 against float64: rounding is relative to the largest gradient entries (a gradient that is zero
    # in exact arithmetic, e.g. a bias that shifts every attention score alike, is float32 noise, which
    # automatic clipping scales by C/γ like everything else)
    # (1e-4: InstanceNorm over 3 values leaves ~1e-4 of float32 noise on a bias it cancels exactly)
    # (and never tighter than 4× float32's own error on this input: an ill-conditioned draw, not the engine)
    tol = max(1e-4 * (1.0 + max(float(r.abs().max()) for r in ref.values() if r.numel())), 4 * float32_error)
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


@settings(deadline=None, max_examples=EXAMPLES + 15)
@given(case=conv_cases(), clip=clip_st, patches=st.booleans())
def test_conv_matches_oracle(case, clip, patches):
    """Every stride, dilation, padding and mode, 1-3 spatial dimensions and groups, with the per-example
    gradients from strided patches or (``patches`` False: no layer counts as having few channels) from the
    grouped kernel."""
    torch.manual_seed(clip["seed"])
    c = case
    conv = CONV[c["n"]](c["cin"], c["cout"], c["k"], c["stride"], c["pad"], c["dil"], c["G"], c["bias"], c["mode"])
    model = PreThen(c["n"], c["cin"], conv)
    with mock.patch.object(conv_mod, "FEW_CHANNELS", conv_mod.FEW_CHANNELS if patches else 0):
        check_oracle(model, torch.randn(clip["B"], c["cin"], *c["size"]), clip)


@pytest.mark.parametrize("cin, groups, patches", [(3, 1, True), (4, 1, True), (8, 2, True), (5, 1, False),
                                                  (16, 2, False)])
def test_few_input_channels_take_the_patch_product_not_the_grouped_kernel(cin, groups, patches):
    """Up to FEW_CHANNELS input channels per group (an RGB input layer, a depthwise convolution) the per-example
    gradients come from one batched product over strided patches, where the grouped kernel was measured 2-3×
    slower; wider layers keep the grouped kernel. Both equal the oracle."""
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, 2 * groups, 3, stride=2, padding=1, groups=groups)
    patched = []
    real = conv_mod.strided_patches

    def spy(module, *args):
        patched.append(module)
        return real(module, *args)

    clip = dict(clipping="layer-wise", clipping_fn="abadi", C=0.05, path="reuse", B=4, seed=3)
    with mock.patch.object(conv_mod, "strided_patches", spy):
        check_oracle(PreThen(2, cin, conv), torch.randn(4, cin, 7, 7), clip)
    assert (conv in patched) == patches


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
    with pytest.raises(UnsupportedLayerError, match="track_running_stats=True"):
        PerSampleEngine(nn.InstanceNorm2d(3, affine=True, track_running_stats=True)).attach()


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
def test_group_norm_backward_is_one_kernel_call_on_the_forwards_statistics(clipping):
    # fp32: the batch folded into the channels gives the input and per-example gradients from one call of
    # PyTorch's backward kernel with the forward's mean/rstd, so backward normalises nothing a second time
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(64, 3))
    x, y = torch.randn(5, 2, 6, 6), torch.randn(5, 3)
    groups = [[f"{i}.weight", f"{i}.bias"] for i in (0, 1, 3)] if clipping == "layer-wise" else None
    ref = clipped_sum(model, per_example_grads(model, loss_fn, x, y), 0.5, clipping, groups=groups)
    engine = PerSampleEngine(model, max_grad_norm=0.5, clipping=clipping).attach()
    with engine.micro_batch(batch_size=5):
        loss = loss_fn(model(x), y)
        with AtenOps() as ops:
            loss.backward()
    assert ops.count("native_group_norm_backward") == 1 and ops.count("native_group_norm") == 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-6, msg=n)


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


def test_rmsnorm_backward_normalises_once():
    # fp32: the input gradient in closed form from one normalisation, whose x̂ the per-example gradients reuse
    # (no forward recomputed under autograd, no second normalisation for the norms)
    torch.manual_seed(0)
    model = RMSNet(6, (6,), None, True)
    x, y = torch.randn(4, 5, 6), torch.randn(4, 10)
    engine = PerSampleEngine(model, max_grad_norm=0.5).attach()
    with engine.micro_batch(batch_size=4):
        loss = loss_fn(model(x), y)
        with AtenOps() as ops:
            loss.backward()
    # one rsqrt normalises; each clipping group's coefficients take one more (clipping.clip_coefficients_sq)
    assert ops.count("rsqrt") == 1 + len(engine.groups) and ops.count("rms_norm", "_fused_rms_norm") == 0


# ---------------------------------------------------------------------------------------------- MultiheadAttention
@st.composite
def mha_cases(draw):
    H, hd = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    mode = draw(st.sampled_from(["self", "cross", "cross_dims"]))
    L = draw(st.integers(1, 5))
    S = L if mode == "self" else draw(st.integers(1, 5))
    mask = draw(st.sampled_from([None, "causal", "float", "float3d"] if L == S else [None, "float", "float3d"]))
    need = draw(st.booleans())
    return dict(H=H, E=H * hd, mode=mode, L=L, S=S, mask=mask, kpm=draw(st.booleans()), bias=draw(st.booleans()),
                bias_kv=draw(st.booleans()), zero_attn=draw(st.booleans()), need=need,
                use_w=need and draw(st.booleans()), avg=draw(st.booleans()),
                kdim=draw(st.integers(1, 4)), vdim=draw(st.integers(1, 4)))


class AttnNet(nn.Module):
    """Self- or cross-attention after trainable projections of the query (and key) inputs; x packs the
    query rows then the key/value rows, so the oracle sees one tensor per example."""

    def __init__(self, c, dropout=0.0):
        super().__init__()
        self.c = c
        E = c["E"]
        kdim, vdim = (c["kdim"], c["vdim"]) if c["mode"] == "cross_dims" else (E, E)
        self.pre = nn.Linear(E, E)
        self.kv = nn.Linear(kdim, kdim) if c["mode"] != "self" else None
        self.mha = nn.MultiheadAttention(E, c["H"], dropout=dropout, bias=c["bias"], add_bias_kv=c["bias_kv"],
                                         add_zero_attn=c["zero_attn"], kdim=kdim, vdim=vdim, batch_first=True)
        self.register_buffer("fmask", torch.randn(c["L"], c["S"]), persistent=False)
        self.dims = kdim, vdim

    def forward(self, x):
        c, L, S = self.c, self.c["L"], self.c["S"]
        q = torch.tanh(self.pre(x[:, :L, :c["E"]]))
        if c["mode"] == "self":
            k = v = q
            src = x[:, :L]
        else:
            src = x[:, L:]
            k, v = self.kv(src[..., :self.dims[0]]), src[..., :self.dims[1]]
        kpm = ((src[..., -1] > 0.7) & (torch.arange(S) > 0)) if c["kpm"] else None  # key 0 always attended
        am = {None: None, "causal": torch.ones(L, S, dtype=torch.bool).triu(1), "float": self.fmask,
              "float3d": (x[:, :L, :1] * src[..., :1].transpose(1, 2)).repeat_interleave(c["H"], 0)}[c["mask"]]
        out, w = self.mha(q, k, v, key_padding_mask=kpm, need_weights=c["need"], attn_mask=am,
                          average_attn_weights=c["avg"], is_causal=c["mask"] == "causal")
        return torch.cat([out.flatten(1), w.flatten(1)], 1) if c["use_w"] else out


def _attn_input(c, B, gen=None):
    F_ = max(c["E"], c["kdim"], c["vdim"])
    return torch.randn(B, c["L"] + (0 if c["mode"] == "self" else c["S"]), F_, generator=gen)


@settings(deadline=None, max_examples=EXAMPLES + 15)
@given(c=mha_cases(), clip=clip_st)
def test_multihead_attention_matches_oracle(c, clip):
    torch.manual_seed(clip["seed"])
    model = AttnNet(c)
    if c["bias_kv"]:
        with torch.no_grad():
            model.mha.bias_k.normal_()
            model.mha.bias_v.normal_()
    hooks = check_oracle(model, _attn_input(c, clip["B"]), clip, merge={"mha.out_proj": "mha"})
    assert "mha.out_proj" not in {name for name, _ in hooks}  # owned by the attention rule


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
def test_transformer_encoder_layer_matches_oracle(clipping):
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), nn.Linear(8, 2))
    clip = dict(clipping=clipping, clipping_fn="abadi", C=0.1, path=None, B=3, seed=0)
    hooks = check_oracle(model, torch.randn(3, 5, 8), clip, merge={"0.self_attn.out_proj": "0.self_attn"})
    assert ("0.self_attn", "MultiheadAttentionRule") in hooks and len(hooks) == 6


def test_multihead_attention_dropout_uses_one_mask_for_forward_and_backward():
    """With C = ∞ the clipped sum is B × the plain mean gradient, drawn with the same dropout mask (same
    seed; the rule draws its mask like PyTorch's need_weights path)."""
    c = dict(H=2, E=4, mode="self", L=5, S=5, mask=None, kpm=False, bias=True, bias_kv=False, zero_attn=False,
             need=True, use_w=False, avg=True, kdim=4, vdim=4)
    torch.manual_seed(0)
    model, x = AttnNet(c, dropout=0.4), _attn_input(c, 3)
    y = torch.randn(3, 20)
    torch.manual_seed(7)
    loss_fn(model(x), y).backward()
    expected = {n: 3 * p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    engine = PerSampleEngine(model, max_grad_norm=math.inf).attach()
    torch.manual_seed(7)
    with engine.micro_batch(batch_size=3):
        loss_fn(model(x), y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-4, atol=1e-6, msg=n)


def test_multihead_attention_eval_and_refusals():
    c = dict(H=2, E=4, mode="cross", L=3, S=2, mask=None, kpm=True, bias=True, bias_kv=True, zero_attn=True,
             need=True, use_w=True, avg=False, kdim=4, vdim=4)
    model, x = AttnNet(c), _attn_input(c, 2)
    with torch.no_grad():
        before = model(x)
    engine = PerSampleEngine(model).attach()
    model.eval()  # the engine steps aside: PyTorch's own forward, with every argument of the call
    with torch.no_grad():
        torch.testing.assert_close(model(x), before)
    engine.detach()
    with pytest.raises(UnsupportedLayerError, match="batch_first=False.*batch_first=True"):
        PerSampleEngine(nn.MultiheadAttention(4, 2)).attach()
    mha = nn.MultiheadAttention(4, 2, batch_first=True)
    eng = PerSampleEngine(mha).attach()
    with eng.micro_batch(batch_size=3):  # every argument by name
        mha(query=torch.randn(3, 2, 4), key=torch.randn(3, 5, 4), value=torch.randn(3, 5, 4))[0].sum().backward()
    assert mha.in_proj_weight.grad is not None
    with eng.micro_batch(batch_size=3), pytest.raises(UnsupportedLayerError, match="same batch size"):
        mha(torch.randn(3, 2, 4), torch.randn(2, 2, 4), torch.randn(2, 2, 4))
    mha.out_proj.weight.data = torch.empty(0)  # what ZeRO-3 leaves when it did not gather out_proj (same object)
    mha.out_proj.weight.ds_shape = (4, 4)
    with eng.micro_batch(batch_size=3), pytest.raises(UnsupportedLayerError, match="set_z3_leaf_modules"):
        mha(*[torch.randn(3, 2, 4)] * 3)


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
    clip = dict(clipping=clipping, clipping_fn="abadi", C=0.05, path=None, B=4, seed=1)
    assert [name for name, _ in check_oracle(model, torch.randn(4, 3), clip)] == ["0", "2"]


class GatedLinear(nn.Linear):  # overrides forward and calls a trainable child: no rule can cover its weight
    def __init__(self):
        super().__init__(3, 2)
        self.gate = nn.Linear(3, 2)

    def forward(self, x):
        return super().forward(x) * torch.sigmoid(self.gate(x))


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
@pytest.mark.parametrize("layer, shape", [(ScaledLinear(3, 2), (4, 3)), (PaddedConv(1, 2, 3), (4, 1, 5, 5))])
def test_subclass_overriding_forward_gets_the_generic_rule(layer, shape, clipping):
    """A subclass that changes what its base computes is no longer refused: the base's rule cannot know its
    forward, so the generic rule (torch.func over the subclass's own forward) clips it, exactly."""
    torch.manual_seed(0)
    clip = dict(clipping=clipping, clipping_fn="abadi", C=0.05, path=None, B=shape[0], seed=1)
    assert check_oracle(nn.Sequential(layer), torch.randn(shape), clip) == [("0", "InstantiatedGradsRule")]


def test_subclass_overriding_forward_with_trainable_children_is_refused():
    with pytest.raises(UnsupportedLayerError, match=r"GatedLinear subclasses Linear but overrides forward"):
        PerSampleEngine(nn.Sequential(GatedLinear())).attach()


def test_unknown_parameter_on_a_supported_layer_gets_the_generic_rule():
    """A parameter the Linear rule does not know: the whole module goes to the generic rule (here the extra
    parameter is unused by the forward: its per-example gradients are zero)."""
    torch.manual_seed(0)
    lin = MyLinear(3, 2)
    lin.scale = nn.Parameter(torch.ones(2))
    clip = dict(clipping="all-layer", clipping_fn="abadi", C=0.05, path=None, B=4, seed=1)
    assert check_oracle(nn.Sequential(lin), torch.randn(4, 3), clip) == [("0", "InstantiatedGradsRule")]


def test_unknown_parameter_on_a_layer_with_trainable_children_is_named():
    lin = GatedLinear()
    lin.scale = nn.Parameter(torch.ones(2))
    with pytest.raises(UnsupportedLayerError, match=r"'scale' of GatedLinear.*\(gate\)"):
        PerSampleEngine(lin).attach()


# ---------------------------------------------------------------------------------------------- the three paths (issue #7)
def _path_model(kind):
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4)), torch.randn(3, 7, 5)
    if kind == "linear_2d":  # T = 1: never kept
        return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4)), torch.randn(3, 5)
    if kind == "hf_conv1d":
        return GPT2MLP(5, 7), torch.randn(3, 6, 5)
    conv = {"conv2d": nn.Conv2d(3, 4, 3, padding=1), "conv2d_groups": nn.Conv2d(4, 6, 3, 2, 1, groups=2),
            "conv2d_reflect": nn.Conv2d(3, 4, 3, padding="same", padding_mode="reflect", bias=False),
            "conv1d_dilated": nn.Conv1d(3, 4, 2, stride=2, dilation=2, padding=1)}[kind]
    n = 1 if isinstance(conv, nn.Conv1d) else 2
    return PreThen(n, conv.in_channels, conv), torch.randn(3, conv.in_channels, *([7] * n))


@pytest.mark.parametrize("kind", ["linear", "linear_2d", "hf_conv1d", "conv2d", "conv2d_groups", "conv2d_reflect",
                                  "conv1d_dilated"])
@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
@pytest.mark.parametrize("path", [None, "ghost", "inst", "reuse"])
def test_each_path_matches_oracle_and_reuse_only_where_the_site_completes(kind, clipping, path):
    """Instantiate-and-reuse keeps per-example gradients for a site that completes its group (the clipped sum
    follows at once: layer-wise) and, for a group completed later (all-layer), only within the memory budget
    (small conv kernels, not these Linears); nothing stays kept afterwards; every path equals the oracle."""
    model, x = _path_model(kind)
    taken, engines = [], []
    real = paths_mod.choose_path

    def spy(*a, **k):
        taken.append(real(*a, **k))
        return taken[-1]

    clip = dict(clipping=clipping, clipping_fn="abadi", C=0.05, path=path, B=x.shape[0], seed=3)
    sites, init = [], Site.__init__

    def track(self, *a):
        init(self, *a)
        sites.append(weakref.ref(self))

    with mock.patch.object(paths_mod, "choose_path", spy), mock.patch.object(Site, "__init__", track):
        check_oracle(model, x, clip, engines=engines)
    if path == "reuse" and clipping == "layer-wise":
        assert set(taken) == {"reuse"}
    elif path in ("ghost", "inst") or kind == "linear_2d":  # T = 1: the cost model
        assert "reuse" not in taken
    elif clipping == "all-layer" and path is None:  # deferred: reuse only within the memory budget
        assert ("reuse" in taken) == (kind in ("conv2d", "conv2d_groups", "conv2d_reflect", "conv1d_dilated"))
    # nothing kept beyond its site: the engine (still alive) holds no site after the pass, no site object
    # survives it, and the rules hold no state at all
    engine = engines[0]
    assert not engine._records and not engine._deferred
    assert sites and all(ref() is None for ref in sites)
    assert all(not vars(rule) for rule in registry.RULES.values())
    # the engine records each layer's path: the choices the cost model (or the forced path) made
    assert set(engine.last_paths.values()) == set(taken)
    assert set(engine.last_paths) == {n for n, m in model.named_modules() if list(m.parameters(recurse=False))}


def test_cost_model_choices():
    """The per-call choice (``benchmarks/per_layer.py`` shapes): reuse where instantiation is cheap against
    the ghost norm and fits the memory cap, ghost otherwise; never reuse where the site does not complete."""
    cp = paths_mod.choose_path
    assert cp(128, 256, 256, True) == "reuse"  # GPT d 256 attention projection
    assert cp(128, 256, 1024, True) == "reuse"  # its MLP
    assert cp(128, 768, 768, True) == "ghost"  # B·p·d above the memory cap
    assert cp(16, 512, 512, True) == "ghost"  # short sequence, wide layer
    assert cp(1024, 144, 32, True) == "reuse"  # early conv
    assert cp(128, 256, 256, False) == "ghost"  # all-layer: the norm alone
    assert cp(512, 64, 64, False) == "instantiate"
    assert cp(1, 256, 256, True) == "instantiate"  # T = 1: the norm is a product of two row norms
    assert cp(128, 256, 256, True, "cuda", torch.bfloat16) == "ghost"  # HBM traffic against tensor cores


class AttentionShaped(nn.Module):
    """q, k and v read one input; o reads their mix, which no other layer reads. At d = p = 128, T = 64 one
    layer's per-example gradients hold exactly as many values as its input and output gradient."""

    def __init__(self, d=128):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        return self.o(torch.tanh(self.q(x)) * self.k(x) + self.v(x))


def test_all_layer_keeps_per_example_gradients_where_they_replace_the_rows_dropped():
    """All-layer (book-keeping) keeps a site's per-example gradients for its clipped sum, instead of its input
    and output gradient, when they are no larger than what it drops: the output projection's whole rows, but
    only a third of the input q, k and v share (so they stay on the ghost norm); the sums match the oracle."""
    torch.manual_seed(0)
    engines: list = []
    check_oracle(AttentionShaped(), torch.randn(2, 64, 128),
                 dict(clipping="all-layer", clipping_fn="abadi", C=0.5, path=None, seed=0), engines=engines)
    taken = engines[0].last_paths
    assert taken["o"] == "reuse" and [taken[n] for n in "qkv"] == ["ghost"] * 3
    readers, x = paths_mod.InputReaders(), torch.randn(2, 64, 128)
    for _ in range(3):
        readers.add(x)
    g = torch.randn(2, 64, 128)
    assert paths_mod.fits_deferred(x, g, 128 * 128) and not paths_mod.fits_deferred(x, g, 128 * 128, readers.of(x))


@pytest.mark.parametrize("deferred_zeros", [False, True])
def test_all_layer_hands_autograd_no_gradient_for_deferred_parameters_unless_a_hook_needs_one(deferred_zeros):
    """All-layer book-keeping writes every clipped sum at the end of backward. Without DeepSpeed (and on ZeRO-0 in
    fp32) nothing reads a gradient before then, so the sites return none: no parameter-sized zeros during the
    backward (an all-layer GPT step on ZeRO-0 peaked 10 MB lower). ZeRO 1-3 and DeepSpeed's 16-bit optimizers
    need each parameter's gradient hook to fire (``deferred_zeros``). The sums match the oracle either way,
    and the guard still refuses a gradient that bypassed the engine."""
    torch.manual_seed(0)
    model, x = AttentionShaped(d=16), torch.randn(3, 5, 16)
    y = torch.randn(3, 5 * 16, generator=torch.Generator().manual_seed(1))
    ref = clipped_sum(model, per_example_grads(model, loss_fn, x, y), 0.5, "all-layer", "abadi")
    engine = PerSampleEngine(model, max_grad_norm=0.5, clipping="all-layer").attach()
    engine.deferred_zeros = deferred_zeros
    seen: list = []
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: seen.append((name, None if g is None else bool(g.eq(0).all()))))
    try:
        with engine.micro_batch(batch_size=3):
            loss_fn(model(x), y).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad.double(), ref[name], rtol=1e-4, atol=1e-6)
        # each parameter's hook sees what the sites returned: zeros, or no gradient at all
        assert sorted(seen) == sorted((n, True if deferred_zeros else None) for n, _ in model.named_parameters())
        model.zero_grad(set_to_none=True)
        with pytest.raises(UnsupportedLayerError, match="'o.weight' received a gradient"), \
                engine.micro_batch(batch_size=3):
            h = model(x)
            (loss_fn(h, y) + torch.nn.functional.linear(x, model.o.weight).sum()).backward()
    finally:
        engine.detach()


class SharedInputs(nn.Module):
    """A decoder block's q, k, v (three Linears reading one input) and a gated MLP's gate and up (two reading
    another), beside a Linear reading a different tensor of the same shape, whose input Gram is not theirs."""

    def __init__(self, d=4):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.gate, self.up, self.other = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(d, 2 * d)

    def forward(self, x):
        h = torch.tanh(self.q(x)) * self.k(x) + self.v(x)
        return torch.sigmoid(self.gate(h)) * self.up(h) + self.other(h.flip(1))


@pytest.mark.parametrize("clip", [dict(clipping="layer-wise"), dict(clipping="all-layer"),
                                  dict(clipping="all-layer", mode="two-pass")])
def test_layers_reading_one_input_share_its_gram(clip):
    """The ghost norms of layers that read one input form its Gram ``a aᵀ`` once (q/k/v: one instead of
    three; gate/up: one instead of two), and still equal the oracle, also beside a layer whose input has the
    same shape but other values."""
    from lightning_dpzero.per_sample.maths import InputGrams

    clip = {"clipping_fn": "abadi", "C": 0.05, "path": "ghost", "B": 3, "seed": 5, "mode": "book-keeping", **clip}
    model, x = SharedInputs(), torch.randn(3, 6, 4)
    check_oracle(model, x, clip)

    def bmm_calls(share: bool) -> int:
        engine = PerSampleEngine(model, max_grad_norm=0.05, clipping=clip["clipping"],
                                 clipping_mode=clip["mode"]).attach()
        real = InputGrams.of
        unshared = lambda self, a: (self.clear(), real(self, a))[1]  # noqa: E731 - forms every Gram afresh
        try:
            with force_path("ghost"), mock.patch.object(InputGrams, "of", real if share else unshared), \
                    engine.micro_batch(batch_size=3), AtenOps() as ops:
                backward(engine, loss_fn(model(x), torch.zeros(3, 6 * 8)))
        finally:
            engine.detach()
        assert engine.input_grams._gram is None  # nothing kept after the backward pass
        return ops.count("bmm")

    assert bmm_calls(share=True) == bmm_calls(share=False) - 3


@pytest.mark.parametrize("d,p", [(8, 64), (64, 8), (16, 16)])
def test_per_example_rows_take_the_faster_layout_and_every_reader_accepts_it(d, p):
    """``rows_per_example`` forms ``(B, d, p)`` where d < p (MKL's bmm is several times slower with the thin
    dimension last: a LoRA up-projection) and returns its transposed view; norms and clipped sums read it as they
    read the contiguous ``(B, p, d)``, without a copy."""
    from lightning_dpzero.per_sample.maths import per_example_sq, rows_per_example, weighted_sum, weighted_sum_parts

    gen = torch.Generator().manual_seed(0)
    a, g, coef = torch.randn(5, 7, d, generator=gen), torch.randn(5, 7, p, generator=gen), torch.rand(5, generator=gen)
    per = rows_per_example(a, g)
    ref = torch.einsum("btp,btd->bpd", g.double(), a.double())
    close = {"rtol": 1e-5, "atol": 1e-5}  # float32 against float64
    torch.testing.assert_close(per.double(), ref, **close)
    assert per.is_contiguous() == (d >= p)
    torch.testing.assert_close(per_example_sq(per).double(), ref.pow(2).sum((1, 2)), **close)
    torch.testing.assert_close(weighted_sum(per, coef).double(), torch.einsum("b,bpd->pd", coef.double(), ref), **close)
    torch.testing.assert_close(weighted_sum_parts(list(per.split(2)), coef), weighted_sum(per, coef))


@pytest.mark.parametrize("d,p,B", [(8, 64, 5), (64, 8, 5), (16, 16, 0)])
def test_weight_and_bias_side_by_side_give_each_norm_and_sum_in_one_op(d, p, B):
    """``joint_rows``: the per-example weight gradients (either layout) and bias rows in one buffer, whose one dot
    is the sum of both squared norms and whose one product (with ``alpha``) splits into the weight's and the
    bias's clipped sums, of their shapes; tensors apart are not ``joined``."""
    from lightning_dpzero.per_sample.maths import joined, joint_rows, rows_per_example, rows_sq, split_sum, weighted_sum

    gen = torch.Generator().manual_seed(0)
    a, g, coef = torch.randn(B, 7, d, generator=gen), torch.randn(B, 7, p, generator=gen), torch.rand(B, generator=gen)
    w, b = joint_rows(B, [p * d, p], g)
    both = [rows_per_example(a, g, out=w), torch.sum(g, 1, out=b)]
    ref_w, ref_b = torch.einsum("btp,btd->bpd", g.double(), a.double()), g.double().sum(1)
    close = {"rtol": 1e-5, "atol": 1e-5}  # float32 against float64
    torch.testing.assert_close(rows_sq(joined(both)).double(), ref_w.pow(2).sum((1, 2)) + ref_b.pow(2).sum(1), **close)
    sw, sb = split_sum(weighted_sum(joined(both), coef, alpha=0.5), both)
    torch.testing.assert_close(sw.double(), 0.5 * torch.einsum("b,bpd->pd", coef.double(), ref_w), **close)
    torch.testing.assert_close(sb.double(), 0.5 * coef.double() @ ref_b, **close)
    assert joined([both[0].clone(), both[1]]) is None


@pytest.mark.parametrize("shape,k,n,contiguous", [((2, 9), 64, 8, True), ((5,), 96, 2, True), ((3, 4), 64, 1, True),
                                                  ((3, 4), 64, 16, True), ((3, 4), 32, 8, True),
                                                  ((3, 4), 64, 8, False), ((0, 4), 64, 8, True)])
def test_narrow_input_gradient_is_formed_transposed_and_equals_the_product(shape, k, n, contiguous):
    """``rows_matmul(a, w)`` is ``a @ w``; where MKL is slow (a contiguous ``w`` with 2-8 columns from 64 or more
    rows: a LoRA up-projection's input gradient) it runs one ``mm`` of ``wᵀ`` and ``aᵀ`` instead, and a
    contiguous result of the same shape comes back."""
    from lightning_dpzero.per_sample.maths import rows_matmul

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(*shape, k, generator=gen)
    w = torch.randn(k, n, generator=gen) if contiguous else torch.randn(n, k, generator=gen).t()
    with AtenOps() as ops:
        out = rows_matmul(a, w)
    torch.testing.assert_close(out.double(), a.double() @ w.double(), rtol=1e-5, atol=1e-5)
    assert out.shape == (*shape, n) and out.is_contiguous()
    transposed = contiguous and 2 <= n <= 8 and k >= 64 and a.numel() > 0
    assert ("clone" in ops.names or "copy_" in ops.names) == transposed, ops.names


@pytest.mark.parametrize("clip", [dict(clipping="layer-wise", clipping_fn="abadi", C=0.05, path=None, B=5, seed=1),
                                  dict(clipping="all-layer", clipping_fn="automatic", C=0.3, path=None, B=3, seed=2)])
def test_low_rank_adapter_pair_matches_oracle(clip):
    """A LoRA-style pair, down-projection (64 → 4) then up-projection (4 → 64): the up-projection's input gradient
    takes the transposed product; every clipped sum equals the oracle's."""
    torch.manual_seed(clip["seed"])
    model = nn.Sequential(nn.Linear(64, 4, bias=False), nn.Linear(4, 64, bias=False), nn.Tanh())
    check_oracle(model, torch.randn(clip["B"], 6, 64), clip)
