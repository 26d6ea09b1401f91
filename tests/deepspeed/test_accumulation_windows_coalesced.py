"""Clipping groups that span layers (all-layer, group-wise) with ``accumulate_grad_batches = K > 1`` on ZeRO 1-3
(docs/design.md, *Where each piece runs*: backward): the update equals the single-process ``torch.func`` oracle on
the union of the step's K·W micro-batches (σ = 0, finite C), and with zero gradients the noise is added once per
optimizer step (std σ·C/B_exp, B_exp = q·N counts every micro-batch of the window).

On these stages the clipped sums of such groups are written inside DeepSpeed's coalesced reduction, one block
per optimizer step; the K - 1 micro-batches before the window's boundary hold theirs in the engine's fp32 window
buffer (``per_sample/window.py``). Without that buffer only the boundary micro-batch reached the update.
"""

import pytest
import torch

from harness import expected_params, run_cases

pytestmark = pytest.mark.slow

BASE = dict(model="token", n=64, batch_size=4, lr=0.5, steps=3, sigma=0.0, C=0.3, clipping="all-layer",
            clipping_fn="abadi", poisson=True, accumulate=2)
# group-wise with a group that is one layer (its clipped sum could be returned through autograd) and one that
# spans three layers (deferred): both must be held over the window
GROUPS = [["net.head.*"], ["net.emb.*", "net.lin.*", "net.ln.*"]]


def _cases():
    cases = []
    for stage in (1, 2, 3):
        for acc in (2, 3):
            cases.append(dict(BASE, name=f"al_s{stage}_a{acc}", stage=stage, accumulate=acc))
            cases.append(dict(BASE, name=f"gw_s{stage}_a{acc}", stage=stage, accumulate=acc, clipping="group-wise",
                              clipping_groups=GROUPS))
    # the optimizer's parameter groups as clipping groups, ZeRO-2
    cases.append(dict(BASE, name="gwopt_s2_a2", stage=2, clipping="group-wise", clipping_groups="param_groups",
                      opt_groups=[["net.emb.*", "net.head.*"], ["net.lin.*", "net.ln.*"]]))
    # automatic clipping and a window that spans two epochs' worth of windows
    cases.append(dict(BASE, name="alauto_s3_a2", stage=3, clipping_fn="automatic", C=0.1, steps=4, max_epochs=2,
                      limit_train_batches=4))
    # empty Poisson micro-batches inside windows (one expected example per rank and micro-batch)
    cases.append(dict(BASE, name="alempty_s2_a3", stage=2, accumulate=3, batch_size=1, steps=4))
    # bf16-mixed: the held sums are fp32, written into the bf16 gradients at the boundary
    cases.append(dict(BASE, name="bf16_al_s3_a2", stage=3, precision="bf16-mixed", C=0.1))
    # the noise: zero gradients, a wide layer (33k coordinates) and a head (all-layer spans both)
    for stage, acc in ((1, 2), (2, 3), (3, 2)):
        cases.append(dict(BASE, name=f"noise_s{stage}_a{acc}", model="wide2", stage=stage, accumulate=acc,
                          sigma=1.5, C=2.0, lr=1.0, steps=1, zero_loss=True, n=256))
    return cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = _cases()
    return cases, run_cases(cases, tmp_path_factory.mktemp("acc_coalesced"), 2)


def _oracle_cases(runs):
    cases, results = runs
    return [(c, results[c["name"]]) for c in cases if not c["name"].startswith(("noise", "bf16"))]


def test_update_equals_the_oracle_on_the_union_of_the_window(runs):
    checked = set()
    for case, res in _oracle_cases(runs):
        per_step = {}
        for seen in res["seen"]:
            for step, idx in seen:
                per_step[step] = per_step.get(step, 0) + 1
        # every update is one window: K micro-batches on each of the 2 ranks
        assert set(per_step.values()) == {2 * case["accumulate"]}, (case["name"], per_step)
        assert res["global_step"] == case["steps"] == sum(e["steps"] for e in res["ledger"]["entries"])
        exp = expected_params(case, res)
        for k, v in exp.items():
            torch.testing.assert_close(res["final"][k], v, rtol=1e-5, atol=1e-6, msg=f"{case['name']} {k}")
        checked.add((case["stage"], case["accumulate"], case["clipping"]))
    assert {(s, a, c) for s in (1, 2, 3) for a in (2, 3) for c in ("all-layer", "group-wise")} <= checked


def test_the_oracle_would_see_a_window_reduced_to_its_last_micro_batch(runs):
    # The comparison is not vacuous: the clipped update of the boundary micro-batches alone (what one coalesced
    # block per micro-batch released on ZeRO-1/2) differs from the window's, and clipping changes the update.
    for case, res in _oracle_cases(runs):
        if case["name"] != "al_s2_a2":
            continue
        last_only = dict(res, seen=[[[s, idx] for j, (s, idx) in enumerate(seen) if j % 2 == 1]
                                    for seen in res["seen"]])
        wrong = expected_params(case, last_only)
        unclipped = expected_params(dict(case, C=float("inf")), res)
        assert any((wrong[k] - res["final"][k]).abs().max() > 1e-4 for k in wrong)
        assert any((unclipped[k] - res["final"][k]).abs().max() > 1e-4 for k in unclipped)
        return
    raise AssertionError("case al_s2_a2 missing")


def test_noise_is_added_once_per_optimizer_step(runs):
    cases, results = runs
    for case in (c for c in cases if c["name"].startswith("noise")):
        res = results[case["name"]]
        b_exp = case["batch_size"] * 2 * case["accumulate"]
        assert res["plan"]["expected_batch_size"] == pytest.approx(b_exp)
        delta = torch.cat([(res["final"][k] - res["init"][k]).flatten() for k in res["final"]]) / case["lr"]
        assert delta.std().item() == pytest.approx(case["sigma"] * case["C"] / b_exp, rel=0.03), case["name"]
        for k in res["final"]:
            torch.testing.assert_close(res["final_rank"][1][k], res["final"][k], rtol=0, atol=0)


def test_bf16_mixed_matches_the_oracle_to_bf16_rounding(runs):
    cases, results = runs
    case = next(c for c in cases if c["name"] == "bf16_al_s3_a2")
    res = results[case["name"]]
    exp = expected_params(case, res)
    unclipped = expected_params(dict(case, C=float("inf")), res)
    err = max((res["final"][k] - exp[k]).abs().max().item() for k in exp)
    gap = max((unclipped[k] - exp[k]).abs().max().item() for k in exp)
    assert err < 1.2e-2 and gap > 4 * err, (err, gap)
