"""Every rule's forward is the layer's own: with the engine attached, a training forward returns what the
module returns without it, in fp32, bf16 and fp16 and under CPU autocast. A rule whose forward computed
something else (another epsilon, another cast) would train a function that the released model, evaluated
without the engine, does not compute.

Bit-equality where the rule calls the module's own code or kernel; where it computes the same operation
another way (InstanceNorm as a GroupNorm with one channel per group, attention and recurrences step by step)
a float tolerance of that dtype. Inputs of small and
of ordinary magnitude: an epsilon of the wrong size shows on the small ones.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dpzero.per_sample import PerSampleEngine

B = 3


def _tokens(shape, high):
    return lambda dtype, scale: torch.randint(1, high, shape)


def _floats(*shape):
    return lambda dtype, scale: (torch.randn(B, *shape) * scale).to(dtype)


def _hf_conv1d():
    from transformers.pytorch_utils import Conv1D

    return Conv1D(6, 5)


def _hf_rmsnorm(module, name):
    def make():
        import importlib

        return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)(6)
    return make


# name: (module factory, input factory, exact): exact = the rule runs the module's own code
LAYERS = {
    "Linear": (lambda: nn.Linear(5, 6), _floats(4, 5), True),
    "Conv1d": (lambda: nn.Conv1d(2, 3, 3, padding="same", padding_mode="reflect"), _floats(2, 7), True),
    "Conv2d": (lambda: nn.Conv2d(2, 3, 3, stride=2, groups=1), _floats(2, 7, 7), True),
    "Conv3d": (lambda: nn.Conv3d(2, 4, 2, groups=2), _floats(2, 4, 4, 4), True),
    "Embedding": (lambda: nn.Embedding(10, 4, padding_idx=0), _tokens((B, 5), 10), True),
    "EmbeddingBag": (lambda: nn.EmbeddingBag(10, 4, mode="mean"), _tokens((B, 5), 10), True),
    "LayerNorm": (lambda: nn.LayerNorm(6), _floats(4, 6), True),
    "LayerNorm eps 0.1": (lambda: nn.LayerNorm([4, 6], eps=0.1), _floats(4, 6), True),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), _floats(4, 5, 5), True),
    "InstanceNorm2d": (lambda: nn.InstanceNorm2d(3, affine=True), _floats(3, 5, 5), False),
    "RMSNorm": (lambda: nn.RMSNorm(6), _floats(4, 6), True),
    "RMSNorm eps 1e-3": (lambda: nn.RMSNorm([4, 6], eps=1e-3), _floats(4, 6), True),
    # attention and the recurrences are computed by their rules (projections, per-step cells), not by
    # PyTorch's fused kernels: the same operations, rounded in another order
    "MultiheadAttention": (lambda: nn.MultiheadAttention(8, 2, batch_first=True), _floats(4, 8), False),
    "LSTM": (lambda: nn.LSTM(5, 6, batch_first=True, num_layers=2, bidirectional=True), _floats(4, 5), False),
    "GRU": (lambda: nn.GRU(5, 6, batch_first=True), _floats(4, 5), False),
    "HF Conv1D": (_hf_conv1d, _floats(4, 5), True),
    "LlamaRMSNorm": (_hf_rmsnorm("llama", "LlamaRMSNorm"), _floats(4, 6), True),
    "GemmaRMSNorm": (_hf_rmsnorm("gemma", "GemmaRMSNorm"), _floats(4, 6), True),
    "T5LayerNorm": (_hf_rmsnorm("t5", "T5LayerNorm"), _floats(4, 6), True),
}

# the dtypes each layer runs in (a combination PyTorch's CPU kernels do not run is skipped)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
       torch.float16: dict(rtol=1e-3, atol=1e-3)}


def _call(module, x):
    if isinstance(module, nn.MultiheadAttention):
        return module(x, x, x, need_weights=False)[0]
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def _forwards(name, dtype, scale, autocast):
    make, inputs, _ = LAYERS[name]
    torch.manual_seed(0)
    module = make()
    if not autocast:
        module = module.to(dtype)
    with torch.no_grad():  # non-trivial affine parameters
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = inputs(torch.float32 if autocast else dtype, scale)
    ctx = torch.autocast("cpu", dtype) if autocast else torch.autocast("cpu", enabled=False)
    try:
        with ctx:
            ref = _call(module, x)
    except (RuntimeError, NotImplementedError) as e:  # the layer itself does not run so on the CPU
        pytest.skip(f"PyTorch's CPU kernels do not run {name} in {dtype}{' autocast' if autocast else ''}: {e}")
    engine = PerSampleEngine(module, max_grad_norm=1.0).attach()
    try:
        with engine.micro_batch(batch_size=B):
            with ctx:
                out = _call(module, x)
            out.float().sum().backward()  # outside autocast, as Lightning and PyTorch's guide run it
    finally:
        engine.detach()
    return out, ref


def _assert_is_the_layers_own(name, out, ref, dtype):
    """Bit for bit where the rule runs the module's own code, else to ``dtype``'s rounding."""
    assert out.dtype == ref.dtype
    if LAYERS[name][2]:
        assert torch.equal(out, ref), (out - ref).abs().max()
    else:
        torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("scale", [1.0, 1e-2])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("name", list(LAYERS))
def test_the_engines_forward_is_the_layers_own(name, dtype, scale):
    dtype = DTYPES[dtype]
    out, ref = _forwards(name, dtype, scale, autocast=False)
    _assert_is_the_layers_own(name, out, ref, dtype)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_the_engines_forward_under_autocast_is_the_layers_own(name, dtype):
    # fp32 parameters and inputs, 16-bit autocast: the rule must follow autocast's policy for the layer
    out, ref = _forwards(name, dtype, 1e-2, autocast=True)
    _assert_is_the_layers_own(name, out, ref, dtype)


# all-layer: the 64-wide layers' per-example gradients are not kept, so their clipped sums are matmuls at the
# end of backward (the engine's deferred writes), which autocast would also turn to 16-bit
LAYERS_INSIDE = {**{k: LAYERS[k] for k in ("Conv1d", "LayerNorm", "MultiheadAttention", "GRU")},
                 "MLP": (lambda: nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)), _floats(64), True)}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
@pytest.mark.parametrize("name", list(LAYERS_INSIDE))
def test_a_backward_called_inside_autocast_gives_what_one_outside_gives(name, clipping):
    # PyTorch's guide calls backward outside autocast; inside it, autocast would also apply to the ops the
    # rules' backward calls (Conv1d's reflect padding became fp32 against bf16 gradients, and the kernel failed)
    grads = []
    for inside in (False, True):
        make, inputs, _ = LAYERS_INSIDE[name]
        torch.manual_seed(0)
        module = make()
        x = inputs(torch.float32, 1.0)
        engine = PerSampleEngine(module, max_grad_norm=1.0, clipping=clipping).attach()
        with engine.micro_batch(batch_size=B):
            with torch.autocast("cpu", torch.bfloat16):
                out = _call(module, x)
                if inside:
                    out.float().sum().backward()
            if not inside:
                out.float().sum().backward()
        engine.detach()
        grads.append([p.grad.clone() for p in module.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
