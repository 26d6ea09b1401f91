"""ClipFraction / MeanGradNorm (torchmetrics with sum states) and dp_hyperparameters / PrivacyRunLogger.

Aggregation over ranks is checked two ways: by merging the states of per-rank metric objects
(``merge_state``, the same sum reduction torchmetrics applies after its all-gather), and for real with
two gloo processes started by a helper script in a subprocess (not by pytest itself).
"""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_dpzero.metrics import ClipFraction, MeanGradNorm

ROOT = Path(__file__).resolve().parents[1]


def test_clip_fraction_over_micro_batches_weights_every_example_once():
    m = ClipFraction(max_grad_norm=1.0)
    m.update(torch.tensor([0.5, 2.0, 3.0]))          # micro-batch 1: 2 of 3 clipped
    m.update(torch.tensor([0.1] * 7))                # micro-batch 2: 0 of 7
    assert m.compute().item() == pytest.approx(2 / 10)  # not the mean of per-batch fractions (1/3)
    m.reset()
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert math.isnan(m.compute().item())        # no example: undefined, not 0


def test_clip_fraction_counts_form_and_norm_at_threshold():
    m = ClipFraction(max_grad_norm=1.0)
    m.update(torch.tensor([1.0, 1.0 + 1e-6]))        # exactly C is not clipped (min(1, C/|g|) = 1)
    assert m.compute().item() == pytest.approx(0.5)
    m.update(3, examples=4)                          # engine counts: stats["clipped"], stats["examples"]
    assert m.compute().item() == pytest.approx(4 / 6)
    m.update(torch.tensor(0), examples=torch.tensor(0))  # an empty Poisson micro-batch changes nothing
    assert m.compute().item() == pytest.approx(4 / 6)
    inf = ClipFraction(max_grad_norm=math.inf)
    inf.update(torch.tensor([1e9]))
    assert inf.compute().item() == 0.0


def test_bad_updates_are_refused():
    with pytest.raises(ValueError, match="max_grad_norm"):
        ClipFraction().update(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="between 0 and"):
        ClipFraction().update(5, examples=4)
    with pytest.raises(ValueError, match="1-D"):
        MeanGradNorm().update(torch.ones(2, 2))
    with pytest.raises(ValueError):
        MeanGradNorm().update(float("nan"), examples=1)
    with pytest.raises(ValueError):
        ClipFraction(max_grad_norm=0.0)


def test_mean_grad_norm_is_the_mean_over_all_examples():
    m = MeanGradNorm()
    m.update(torch.tensor([1.0, 3.0]))
    m.update(12.0, examples=4)                       # sum of 4 norms, from the engine's stats
    assert m.compute().item() == pytest.approx(16 / 6)
    m.reset()
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert math.isnan(m.compute().item())


def test_two_ranks_merge_to_the_global_value():
    # Rank 0 saw 10 examples (1 clipped, norms summing to 6), rank 1 saw 2 (both clipped, sum 9).
    # The per-rank fractions 0.1 and 1.0 average to 0.55; the right answer over 12 examples is 3/12.
    r0c, r1c = ClipFraction(), ClipFraction()
    r0n, r1n = MeanGradNorm(), MeanGradNorm()
    r0c.update(1, examples=10)
    r1c.update(2, examples=2)
    r0n.update(6.0, examples=10)
    r1n.update(9.0, examples=2)
    for state in ("clipped", "examples"):
        assert r0c._reductions[state] is not None  # sum states, reduced across ranks
    r0c.merge_state(r1c)
    r0n.merge_state(r1n)
    assert r0c.compute().item() == pytest.approx(3 / 12)
    assert r0n.compute().item() == pytest.approx(15 / 12)


def test_dist_sync_sums_states_of_simulated_ranks():
    # torchmetrics' own sync path with a stand-in all-gather that returns both "ranks'" states.
    other = ClipFraction()
    other.update(2, examples=2)
    others = iter([other.clipped, other.examples])  # states are gathered in their registration order

    def fake_all_gather(tensor, group=None):
        return [tensor, next(others)]

    m = ClipFraction(dist_sync_fn=fake_all_gather, distributed_available_fn=lambda: True)
    m.update(1, examples=10)
    assert m.compute().item() == pytest.approx(3 / 12)


_TWO_RANKS = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import torch.multiprocessing as mp
    from lightning_dpzero.metrics import ClipFraction, MeanGradNorm

    def work(rank, init_file):
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
        c, n = ClipFraction(max_grad_norm=1.0), MeanGradNorm()
        # rank 0: two micro-batches, 5 + 5 examples, 1 clipped; rank 1: one micro-batch of 2, both clipped
        batches = [torch.tensor([0.5] * 4 + [2.0]), torch.tensor([0.5] * 5)] if rank == 0 else [torch.tensor([4.0, 5.0])]
        for b in batches:
            c.update(b)
            n.update(b)
        frac, mean = c.compute().item(), n.compute().item()  # collectives: both ranks call
        print(f"rank={rank} clip_fraction={frac:.6f} mean_grad_norm={mean:.6f}", flush=True)
        # a step where this rank had no example still takes part in the sync
        c.reset(); n.reset()
        if rank == 1:
            c.update(torch.tensor([3.0])); n.update(torch.tensor([3.0]))
        print(f"rank={rank} empty_here clip_fraction={c.compute().item():.6f} mean={n.compute().item():.6f}", flush=True)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(work, args=(sys.argv[1],), nprocs=2)
""")


@pytest.mark.slow
def test_two_gloo_processes_sum_states(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "init")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    # 12 examples: 3 clipped; norm sum 2 + 4*0.5 + 5*0.5 + 9 = 15.5
    for rank in (0, 1):
        assert f"rank={rank} clip_fraction={3 / 12:.6f} mean_grad_norm={15.5 / 12:.6f}" in out, out
        assert f"rank={rank} empty_here clip_fraction=1.000000 mean=3.000000" in out, out


def test_dp_hyperparameters_reads_the_plan():
    from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback
    from lightning_dpzero.metrics import dp_hyperparameters
    from lightning_dpzero.accounting.plan import PrivacyPlan

    strategy = DPDeepSpeedStrategy(stage=3, max_grad_norm=0.5, clipping="all-layer", clipping_fn="automatic")
    strategy.mechanism.plan = PrivacyPlan(dataset_size=1000, sample_rate=0.064, expected_batch_size=64.0,
                                noise_multiplier=1.1, delta=1e-5, planned_steps=300, sampler_kind="poisson",
                                accountant="pld", target_epsilon=8.0)
    accountant = PrivacyAccountantCallback(target_epsilon=8.0, delta=1e-5)
    trainer = SimpleNamespace(strategy=strategy, callbacks=[accountant], world_size=2, accumulate_grad_batches=1)
    hp = dp_hyperparameters(trainer)
    assert hp["noise_multiplier"] == 1.1 and hp["sample_rate"] == 0.064 and hp["max_grad_norm"] == 0.5
    assert hp["delta"] == 1e-5 and hp["target_epsilon"] == 8.0 and hp["dataset_size"] == 1000
    assert hp["clipping"] == "all-layer" and hp["clipping_fn"] == "automatic" and hp["gamma"] == 0.01
    assert hp["clipping_mode"] == "book-keeping"
    assert hp["zero_stage"] == 3 and hp["sampler"] == "poisson" and hp["planned_steps"] == 300
    assert hp["world_size"] == 2 and hp["accountant"] == "pld"
    with pytest.raises(TypeError):
        dp_hyperparameters(SimpleNamespace(strategy=object(), callbacks=[]))
