"""The CUDA code path: DeepSpeed ZeRO 0/2/3 on one GPU in fp32, bf16-mixed and fp16 (16-mixed), against the
per-example oracle. Skipped where there is no CUDA device (the CPU suite checks the same invariants with gloo).

fp16 is DeepSpeed's own mixed precision (fp16 weights, fp32 master weights, a dynamic loss scale), which
DeepSpeed's CPU accelerator refuses, so only a GPU runs it end to end: the engine divides the loss scale out
before it takes the per-example norms (docs/design.md, *Precision*), and a wrong scale there would clip the
wrong examples. ``benchmarks/gpu.sh`` runs this file first on the GPU machine.
"""

import math

import pytest
import torch

from harness import FP16, check_bf16_against_oracle, check_noise_std, expected_params, run_cases

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BASE = dict(model="token", n=64, batch_size=4, lr=0.5, steps=3, sigma=0.0, C=0.3, clipping="layer-wise",
            clipping_fn="abadi", poisson=True, accumulate=1, accelerator="gpu")


def cuda_cases(accelerator="gpu"):
    """Every case, on ``accelerator`` (``"cpu"`` leaves out fp16, which DeepSpeed's CPU accelerator refuses)."""
    base = dict(BASE, accelerator=accelerator)
    cases = []
    for stage in (0, 3):  # I1: σ = 0 and C = ∞ is plain training on the same logical batches
        cases.append(dict(base, name=f"i1_s{stage}", stage=stage, C=math.inf, poisson=False))
    for stage, clipping, acc in ((0, "layer-wise", 2), (2, "layer-wise", 1), (3, "layer-wise", 2),
                                 (2, "all-layer", 2), (3, "all-layer", 1)):
        cases.append(dict(base, name=f"i2_{clipping}_s{stage}_a{acc}", stage=stage, clipping=clipping, accumulate=acc))
    cases.append(dict(base, name="i2_2pass_s3_a2", stage=3, accumulate=2, clipping="all-layer",
                      clipping_mode="two-pass"))
    for stage, clipping in ((0, "layer-wise"), (2, "layer-wise"), (3, "all-layer")):
        cases.append(dict(base, name=f"bf16_{clipping}_s{stage}", stage=stage, clipping=clipping,
                          precision="bf16-mixed", C=0.1))
    cases.append(dict(base, name="bf16_2pass_s2", stage=2, clipping="all-layer", clipping_mode="two-pass",
                      precision="bf16-mixed", C=0.1))
    if accelerator == "gpu":
        # (ZeRO-0's fp16 is refused: DeepSpeed leaves the loss unscaled there, tests/per_sample/test_precision.py)
        for stage, clipping, acc in ((1, "layer-wise", 1), (2, "layer-wise", 2), (3, "layer-wise", 1),
                                     (2, "all-layer", 1), (3, "all-layer", 2)):
            cases.append(dict(base, **FP16, name=f"fp16_{clipping}_s{stage}_a{acc}", stage=stage,
                              clipping=clipping, accumulate=acc))
    # I3: zero per-example gradients, so the update is lr × noise, drawn on the GPU (and from OS entropy)
    for stage, secure in ((0, False), (3, False), (0, True)):
        cases.append(dict(base, name=f"i3_s{stage}{'_secure' if secure else ''}", model="wide", stage=stage,
                          secure_mode=secure, sigma=1.5, C=2.0, lr=1.0, steps=1, zero_loss=True, n=256))
    return cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = cuda_cases()
    results = run_cases(cases, tmp_path_factory.mktemp("cuda"), 1)
    return {c["name"]: (c, results[c["name"]]) for c in cases}


def _named(runs, prefix):
    found = [(c, r) for name, (c, r) in runs.items() if name.startswith(prefix)]
    assert found, prefix
    return found


def test_sigma0_cinf_on_cuda_equals_non_private_training(runs):
    for case, res in _named(runs, "i1_"):
        exp = expected_params(case, res)
        for k, v in exp.items():
            assert not torch.equal(res["final"][k], res["init"][k]), f"{case['name']}: {k} never moved"
            # the GPU's fp32 sums run in another order than the CPU replay's
            torch.testing.assert_close(res["final"][k], v, rtol=1e-4, atol=1e-5, msg=f"{case['name']} {k}")


def test_clipping_on_cuda_matches_the_per_example_oracle(runs):
    for case, res in _named(runs, "i2_"):
        exp = expected_params(case, res)
        unclipped = expected_params(dict(case, C=math.inf), res)
        assert any((unclipped[k] - exp[k]).abs().max() > 1e-3 for k in exp), case["name"]  # clipping bit
        for k, v in exp.items():
            torch.testing.assert_close(res["final"][k], v, rtol=1e-4, atol=1e-5, msg=f"{case['name']} {k}")


def test_bf16_mixed_on_cuda_matches_the_oracle_to_bf16_rounding(runs):
    for case, res in _named(runs, "bf16_"):
        check_bf16_against_oracle(case, res)


def test_fp16_with_deepspeeds_loss_scale_matches_the_oracle_to_fp16_rounding(runs):
    for case, res in _named(runs, "fp16_"):
        # a step skipped for an fp16 overflow is not in the replay: it would fail the comparison for that reason
        assert res["deepspeed_skipped_steps"] == 0, case["name"]
        check_bf16_against_oracle(case, res)


def test_noise_drawn_on_cuda_has_std_sigma_c_over_the_expected_batch(runs):
    for case, res in _named(runs, "i3_"):
        check_noise_std(case, res, 1)


def test_one_ledger_event_per_optimizer_step_on_cuda(runs):
    for case, res in runs.values():
        entries = res["ledger"]["entries"]
        assert sum(e["steps"] for e in entries) == res["global_step"] == case["steps"], case["name"]
        assert res["deepspeed_global_steps"] == res["global_step"], case["name"]
