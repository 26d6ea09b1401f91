"""Precision: norms and coefficients in fp32, the fp16 loss scale divided out before norms.

The loss-scale path is checked on the engine directly (an fp16 model with a loss scale S must clip the same
examples as the fp32 model, and its emitted gradient, × S, which DeepSpeed divides out, must match) and end to
end through DeepSpeed's fp16 on ZeRO 1/2/3, whose CPU accelerator is let run fp16 (it refuses it otherwise;
bf16-mixed runs are checked in test_invariants.py).
"""

import pytest
import torch
from torch import nn

from harness import FP16, check_bf16_against_oracle, run_cases
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


# ------------------------------------------------- DeepSpeed's fp16 end to end (its CPU accelerator let run fp16)
FP16_CASES = [dict(name=f"fp16_{clipping}_s{stage}_a{acc}", model="token", n=64, batch_size=4, lr=0.5, steps=3,
                   sigma=0.0, clipping=clipping, clipping_fn="abadi", poisson=True, accumulate=acc, stage=stage,
                   cpu_fp16=True, **FP16)
              for stage, clipping, acc in ((1, "layer-wise", 2), (2, "all-layer", 1), (3, "layer-wise", 2))]
# at DeepSpeed's default initial loss scale 2^16 the gradient reaching the fp16 loss (the scale, above fp16's 65504)
# overflows, and at 2^15 this model's gradients still do: those two steps are skipped (and charged), the scale
# drops to 2^14, and the later steps train
FP16_OVERFLOW_CASES = [dict(case, name=f"{case['name']}_overflow", steps=4, skipped_steps=[0, 1],
                            strategy_kwargs={"initial_scale_power": 16}) for case in FP16_CASES[1:]]


@pytest.mark.slow
def test_fp16_with_deepspeeds_loss_scale_matches_the_oracle(tmp_path):
    """fp16 weights, fp32 master weights and DeepSpeed's dynamic loss scale on ZeRO 1/2/3: the engine reads the
    loss scale from the loss's gradient, clips the unscaled per-example gradients and hands DeepSpeed the scaled
    sums; the run ends at the oracle's parameters to fp16 rounding (tests/lightning/test_cuda.py runs it on a GPU). At
    DeepSpeed's default loss scale the fp16 loss itself overflows: DeepSpeed skips those steps as it does without
    DP (every gradient emitted is NaN), the ledger charges them, and training goes on."""
    results = run_cases(FP16_CASES + FP16_OVERFLOW_CASES, tmp_path, 1)
    for case in FP16_CASES + FP16_OVERFLOW_CASES:
        res = results[case["name"]]
        # the replay leaves out exactly the steps DeepSpeed skipped for an overflow
        assert res["deepspeed_skipped_steps"] == len(case.get("skipped_steps", ())), case["name"]
        check_bf16_against_oracle(case, res)
        entries = res["ledger"]["entries"]
        assert sum(e["steps"] for e in entries) == res["global_step"] == case["steps"], case["name"]  # all charged


def test_fp16_is_refused_where_deepspeed_leaves_the_loss_unscaled(monkeypatch):
    """DeepSpeed 0.19's fp16 at ZeRO stage 0 divides the gradients by a loss scale it never put on the loss (every
    update S times too small, DP or not): refused at the first backward, before any update, with the way out."""
    import deepspeed.accelerator
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dpzero import DPDeepSpeedStrategy

    monkeypatch.setattr(type(deepspeed.accelerator.get_accelerator()), "is_fp16_supported", lambda self: True)

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = _model()
            self.updates = 0

        def training_step(self, batch, _):
            return nn.functional.cross_entropy(self.body(batch[0]).float(), batch[1])

        def on_before_optimizer_step(self, optimizer):
            self.updates += 1

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(32, 16), torch.randint(0, 4, (32,))), batch_size=4)

    net = Net()
    trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=0, noise_multiplier=1.0, initial_scale_power=8),
                        accelerator="cpu", devices=1, max_steps=2, precision="16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match=r"(?s)did not multiply the loss by its fp16 loss scale \(256\).*"
                                           r"256 times too small.*ZeRO stage 0.*bf16-mixed.*stage 1 or above"):
        trainer.fit(net)
    assert net.updates == 0
