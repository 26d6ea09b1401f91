"""Precision: norms and coefficients in fp32, the fp16 loss scale divided out before norms.

DeepSpeed's CPU accelerator refuses fp16 (bf16-mixed runs are checked in test_invariants.py), so the
loss-scale path is checked on the engine directly: an fp16 model with a loss scale S must clip the same
examples as the fp32 model, and its emitted gradient (× S, which DeepSpeed divides out) must match.
"""

import pytest
import torch
from torch import nn

from lightning_dpzero.per_sample import PerSampleEngine
from oracle import per_example_grads


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, 4))


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
def test_fp16_with_loss_scale_clips_the_same_examples_as_fp32(clipping):
    x, y = torch.randn(12, 16) * torch.linspace(0.1, 3, 12).view(-1, 1), torch.randint(0, 4, (12,))
    pe = per_example_grads(_model(), nn.functional.cross_entropy, x, y)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in pe.values()]).sum(0).sqrt()
    srt = norms.sort().values
    C = float(srt[5] + srt[6]) / 2  # half the examples clipped, none near the threshold
    grads, clipped = {}, {}
    for dtype, S in ((torch.float32, 1.0), (torch.float16, 1024.0)):
        model = _model().to(dtype)
        engine = PerSampleEngine(model, max_grad_norm=C, clipping=clipping).attach()
        with engine.micro_batch(batch_size=12, grad_scale=1.0 / S, emit_scale=S):
            (nn.functional.cross_entropy(model(x.to(dtype)).float(), y) * S).backward()
        grads[dtype] = {n: p.grad.float() / S for n, p in model.named_parameters()}
        clipped[dtype] = engine.stats["clipped"]
        assert 0 < engine.stats["clipped"] < 12  # some examples clipped, some not: the comparison means something
    assert clipped[torch.float16] == clipped[torch.float32]
    for n, g in grads[torch.float32].items():
        torch.testing.assert_close(grads[torch.float16][n], g, rtol=2e-2, atol=2e-3, msg=n)


def test_norms_are_fp32_for_half_inputs():
    model = _model().half()
    engine = PerSampleEngine(model, max_grad_norm=1.0).attach()
    seen = []
    engine._update_stats = lambda norms: seen.append(norms.dtype)
    with engine.micro_batch(batch_size=3):
        model(torch.randn(3, 16).half()).float().sum().backward()
    assert seen == [torch.float32]
