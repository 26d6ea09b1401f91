"""Beyond one machine (issue #6): two nodes of one process each against one node of two processes.

The two-node run is simulated on this machine, twice, with ``Trainer(num_nodes=2, devices=1)``: two processes on
127.0.0.1, each with the environment of Lightning's manual multi-node launch (NODE_RANK 0/1, LOCAL_RANK 0,
LOCAL_WORLD_SIZE 1, RANK 0/1, WORLD_SIZE 2, MASTER_ADDR/MASTER_PORT; Lightning's ``LightningEnvironment``), and
two real ``torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0|1`` agents (static rendezvous; Lightning's
``TorchElasticEnvironment``, node rank from GROUP_RANK). The reference is ``Trainer(num_nodes=1, devices=2)``
with LOCAL_RANK 0/1. Same model, data, seed, DP settings (σ calibrated to a target ε) and ZeRO stage 3.

What is guaranteed, and asserted: q = B·W·K/N and B_exp = q·N use the global world size W; the Poisson sampler
of global rank r owns the shard r, r+W, ... and draws from a generator seeded by (seed, epoch, r, pass); the
noise of a ZeRO partition is drawn from seed + r. None of these depends on the node layout, so with one seed
the two layouts see the same batches on every global rank, charge the same ledger, and (σ > 0) end with the
same weights. A strategy that took W from devices per node, or a rank from the local rank, fails here.
"""

import json

import pytest
import torch

from harness import run_cases

pytestmark = pytest.mark.slow

CASE = dict(name="mn_s3", model="token", n=64, batch_size=4, accumulate=1, lr=0.5, steps=4, stage=3,
            sigma=None, target_epsilon=4.0, C=0.5, clipping="layer-wise", clipping_fn="abadi", poisson=True,
            seed=1234, record_ranks=True)


#: (name, nodes, launcher, Lightning's cluster environment): the reference, then the two two-node launches
LAYOUTS = (("1x2", 1, "env", "LightningEnvironment"),
           ("2x1", 2, "env", "LightningEnvironment"),              # NODE_RANK, LOCAL_RANK, RANK, WORLD_SIZE set
           ("2x1-torchrun", 2, "torchrun", "TorchElasticEnvironment"))  # two real torchrun agents
TWO_NODES = ("2x1", "2x1-torchrun")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for layout, nodes, launcher, _ in LAYOUTS:
        d = tmp_path_factory.mktemp(layout)
        res = run_cases([dict(CASE, num_nodes=nodes)], d, 2, nodes=nodes, launcher=launcher)[CASE["name"]]
        res["ranks"] = [json.loads((d / f"{CASE['name']}.rank{r}.json").read_text()) for r in range(2)]
        out[layout] = res
    return out


def _entries(ledger):
    return [{k: e[k] for k in ("sample_rate", "noise_multiplier", "steps", "sampler")} for e in ledger["entries"]]


def test_layout_is_what_each_launch_says(runs):
    for layout, nodes, _, environment in LAYOUTS:
        devices = 2 // nodes
        for r, info in enumerate(runs[layout]["ranks"]):
            assert info["cluster_environment"] == environment, layout
            assert (info["global_rank"], info["world_size"]) == (r, 2), layout
            assert (info["num_nodes"], info["num_devices"]) == (nodes, devices), layout
            assert (info["node_rank"], info["local_rank"]) == ((r, 0) if nodes == 2 else (0, r)), layout
            # the sampler is sharded over the whole world by global rank, not over the node's devices
            assert (info["sampler_rank"], info["sampler_replicas"]) == (r, 2), layout


@pytest.mark.parametrize("layout", TWO_NODES)
def test_same_ledger_and_noise_calibration(runs, layout):
    a, b = runs["1x2"], runs[layout]
    q = CASE["batch_size"] * 2 * CASE["accumulate"] / CASE["n"]  # W = 2 processes in all, whatever the layout
    sigma = a["plan"]["noise_multiplier"]
    assert sigma > 0
    for res in (a, b):
        assert res["global_step"] == CASE["steps"]
        assert res["plan"]["sample_rate"] == q and res["plan"]["expected_batch_size"] == q * CASE["n"]
        assert res["plan"]["noise_multiplier"] == sigma  # σ calibrated from the target on identical inputs
        assert _entries(res["ledger"]) == [{"sample_rate": q, "noise_multiplier": sigma, "steps": CASE["steps"],
                                            "sampler": "poisson"}]
        assert res["ledger"]["dataset_size"] == CASE["n"] and res["ledger"]["delta"] == 1e-5
        assert 0.99 * CASE["target_epsilon"] <= res["epsilon"] <= CASE["target_epsilon"]
        # every rank used the same plan and the same noise scales: gradient factor W/B_exp, std σC/B_exp
        b_exp = q * CASE["n"]
        for info in res["ranks"]:
            assert info["plan"] == res["plan"]
            assert info["noise_scales"] == pytest.approx([2 / b_exp, sigma * CASE["C"] / b_exp], rel=1e-12)
            assert _entries(info["ledger"]) == _entries(res["ledger"])
            assert info["ledger"]["run_id"] == res["ledger"]["run_id"]  # one ledger document on every rank
            assert info["epsilon"] == res["epsilon"]
    assert a["epsilon"] == b["epsilon"]
    assert a["ranks"][0]["noise_scales"] == b["ranks"][0]["noise_scales"]


@pytest.mark.parametrize("layout", TWO_NODES)
def test_same_poisson_batches_per_global_rank(runs, layout):
    a, b = runs["1x2"], runs[layout]
    for r in range(2):
        assert a["seen"][r] == b["seen"][r], f"rank {r} saw different micro-batches in the two layouts"
        for step, idx in a["seen"][r]:
            assert all(i % 2 == r for i in idx), f"rank {r} left its shard r, r+W, ... at step {step}"
    steps = sorted({s for s, _ in a["seen"][0]})
    assert steps == list(range(CASE["steps"]))
    union = [sorted(i for r in range(2) for s, idx in a["seen"][r] if s == step for i in idx) for step in steps]
    assert sum(map(len, union)) > 0 and all(len(u) == len(set(u)) for u in union)


@pytest.mark.parametrize("layout", TWO_NODES)
def test_same_final_weights(runs, layout):
    a, b = runs["1x2"], runs[layout]
    for k, v in a["final"].items():
        assert not torch.equal(v, a["init"][k]), f"{k} never moved"
        torch.testing.assert_close(b["init"][k], a["init"][k], rtol=0, atol=0)
        torch.testing.assert_close(b["final"][k], v, rtol=1e-6, atol=1e-7, msg=f"{k} differs between layouts")
    for r in range(2):  # each rank gathered the same full parameters
        for k, v in b["final_rank"][r].items():
            torch.testing.assert_close(v, b["final"][k], rtol=0, atol=0)
