"""How many operators the engine's backward dispatches per clipping site, and that it reads nothing back to the host.

On a GPU a step of small layers is bound by the kernels it launches, one or more per operator, and stalls at
every device-to-host read; on the CPU both can be counted (``benchmarks.op_count``, which counts a whole
optimizer step through the Trainer). Here the backward of a 2-block GPT (d 128, T 64, B 8) with the engine
attached against the same backward without it: the compute operators (``benchmarks.op_count.is_compute``: no
views, no empty allocations) that each clipping site adds, and the ratio. A change that adds an operator to
every site fails these; one that removes some should lower the bounds. Counts, not times.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.models import build_model, loss_fn, make_data
from benchmarks.op_count import OpCounter
from lightning_dpzero.per_sample import PerSampleEngine

KW = dict(d_model=128, seq=64, layers=2, heads=4, vocab=256)
B = 8
#: measured on this configuration: extra compute ops per site (the bound adds 0.5) and the backward's ratio to
#: non-DP (the bound adds 0.1); 20 sites: 2 embeddings, 2 × (2 LayerNorms, 6 Linears), the final LayerNorm and head
ACHIEVED = {"layer-wise": (6.8, 3.23), "all-layer": (6.65, 3.18)}


def _backward_ops(clipping):
    """The operators of the second backward (the first builds what is cached) and the number of sites."""
    torch.manual_seed(0)
    model = build_model("gpt", **KW)
    x, y = make_data("gpt", B, seed=1, **KW)
    engine = PerSampleEngine(model, 1.0, clipping).attach() if clipping else None
    sites = []
    if engine is not None:
        register = engine._register_site
        engine._register_site = lambda hook: (sites.append(hook), register(hook))
    for _ in range(2):
        sites.clear()
        counter = OpCounter()
        if engine is None:
            loss = loss_fn(model(x), y)
            with counter:
                loss.backward()
        else:
            with engine.micro_batch(batch_size=B):
                loss = loss_fn(model(x), y)
                with counter:
                    loss.backward()
        model.zero_grad(set_to_none=True)
    return counter, len(sites)


@pytest.fixture(scope="module")
def non_dp():
    return _backward_ops(None)[0]


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
def test_engine_ops_per_site_do_not_grow(clipping, non_dp):
    counter, sites = _backward_ops(clipping)
    base, ours = sum(non_dp.compute.values()), sum(counter.compute.values())
    per_site, ratio = (ours - base) / sites, ours / base
    bound_site, bound_ratio = ACHIEVED[clipping]
    extra = {k: v - non_dp.compute.get(k, 0) for k, v in counter.compute.items() if v != non_dp.compute.get(k, 0)}
    assert sites == 20
    assert per_site <= bound_site + 0.5 and ratio <= bound_ratio + 0.1, (
        f"{clipping}: {per_site:.2f} extra compute ops per site (bound {bound_site + 0.5}), {ratio:.2f}x non-DP "
        f"(bound {bound_ratio + 0.1}); extra ops by name: {extra}")
    # the backward reads nothing back: every device-to-host read would stall a GPU's queue
    assert sum(counter.syncs.values()) == 0, dict(counter.syncs)
