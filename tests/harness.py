"""Launch ``dp_worker.py`` on W CPU processes (gloo) the way torchrun would, and rebuild references."""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from models import LOOP_ORACLE, build_model, make_dataset
from oracle import clipped_sum, loop_per_example_grads, per_example_grads, per_example_grads_loop, unit_means

HERE = Path(__file__).parent

#: a case's settings for DeepSpeed's fp16 (``16-mixed``): a small initial loss scale (2^8), so the first steps do
#: not overflow, DeepSpeed skips none and the replay applies every step; C small enough that clipping shows
FP16 = dict(precision="16-mixed", C=0.1, strategy_kwargs={"initial_scale_power": 8})

#: a case's ``zero_config`` that partitions every ZeRO-3 parameter (no persistence threshold), prefetches none
#: and releases each module's parameters after use (reuse distance 0): each backward pass must gather them
ZERO3_EVERY_PARAM_PARTITIONED = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                                 "stage3_prefetch_bucket_size": 0}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(cases, out_dir, world_size, timeout=600, nodes=1, launcher="env", worker="dp_worker.py"):
    """Run every case on ``world_size`` processes; returns ``{name: result}``.

    ``nodes > 1`` simulates that many machines of ``world_size // nodes`` processes each (all on 127.0.0.1):
    every process gets the environment of a multi-node launch (NODE_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE of its
    node; RANK and WORLD_SIZE global), and each case must say ``num_nodes=nodes`` (the worker's Trainer gets
    ``num_nodes`` and ``devices = world_size // nodes``). ``launcher="torchrun"`` starts one real ``torchrun``
    agent per simulated node instead (static rendezvous on 127.0.0.1), which starts that node's processes.
    ``worker``: the script in tests/ each process runs (``fabric_worker.py``: the same cases in a Fabric loop)."""
    if world_size % nodes or any(c.get("num_nodes", 1) != nodes for c in cases):
        raise ValueError(f"{world_size} processes on {nodes} nodes: world_size must divide evenly and every case "
                         f"must have num_nodes={nodes}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = out_dir / "cases.json"
    cfg.write_text(json.dumps(cases))
    for attempt in range(3):
        for marker in out_dir.glob("done*"):
            marker.unlink()
        codes = _launch(cfg, out_dir, world_size, timeout, nodes, launcher, worker)
        log = (out_dir / "rank0.log").read_text()
        # Only a lost race for the rendezvous port is retried; any other failure is reported.
        if not any(codes) or "address already in use" not in log.lower():
            break
    if any(codes) and not _aborted_after_finishing(out_dir, world_size, codes):
        raise RuntimeError(f"worker exit codes {codes}\n{failure_text(log)}")
    results = {}
    for case in cases:
        res = torch.load(out_dir / f"{case['name']}.pt", weights_only=False)
        res["seen"] = [json.loads((out_dir / f"{case['name']}.seen{r}.json").read_text()) for r in range(world_size)]
        res["final_rank"] = [torch.load(out_dir / f"{case['name']}.final{r}.pt") for r in range(world_size)]
        if case.get("count_barriers"):
            res["barriers"] = [json.loads((out_dir / f"{case['name']}.barriers{r}.json").read_text())
                               for r in range(world_size)]
        results[case["name"]] = res
    return results


def failure_text(log: str, size: int = 4000) -> str:
    """What a failed run's log says: a refusal prints its message first and then "Raised at (most recent call
    last):" with the frames, so the message precedes the traceback and a plain tail of the log would cut it off."""
    at = log.rfind("Raised at (most recent call last):")
    if at < 0:
        return log[-size:]
    return f"{log[max(0, at - size // 2):at]}[...]\n{log[-size // 2:]}"


def _aborted_after_finishing(out_dir: Path, world_size: int, codes: list[int]) -> bool:
    """Every rank wrote its ``done`` marker after the last case's barrier, and the ranks that exited non-zero were
    killed by a signal: gloo rarely aborts (SIGABRT) a process whose peer has already exited, after all the
    work. A rank that raised, or failed before the end, wrote no marker and is reported."""
    return (all((out_dir / f"done{r}").exists() for r in range(world_size))
            and all(c <= 0 for c in codes))


def _launch(cfg, out_dir, world_size, timeout, nodes=1, launcher="env", worker="dp_worker.py"):
    port = _free_port()
    per_node = world_size // nodes
    procs = []
    if launcher == "torchrun":  # rank{n}.log: node n's agent and its workers
        env = {k: v for k, v in os.environ.items() if k not in (
            "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        for node in range(nodes):
            log = open(out_dir / f"rank{node}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
                 f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
                 str(HERE / worker), str(cfg), str(out_dir)], env=env, stdout=log, stderr=subprocess.STDOUT))
        return [p.wait(timeout=timeout) for p in procs]
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                   RANK=str(rank), LOCAL_RANK=str(rank % per_node), NODE_RANK=str(rank // per_node),
                   LOCAL_WORLD_SIZE=str(per_node), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(HERE / worker), str(cfg), str(out_dir)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
    return [p.wait(timeout=timeout) for p in procs]


def expected_params(case, result):
    """Replay the run: per optimizer step, Σ clip(g_i) over the union batch (torch.func), / B_exp, SGD."""
    model = build_model(case["model"])
    missing, unexpected = model.load_state_dict({k.removeprefix("net."): v for k, v in result["init"].items()},
                                                strict=False)
    # the worker records named_parameters(): a tied weight once, and no buffers (built from the config)
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    assert not unexpected and set(missing) <= aliases | {n for n, _ in model.named_buffers()}, (missing, unexpected)
    x, y = make_dataset(case["model"], case["n"])
    b_exp = result["plan"]["expected_batch_size"]
    steps: dict[int, list[int]] = {}
    for rank_seen in result["seen"]:
        for step, idx in rank_seen:
            steps.setdefault(step, []).extend(idx)
    C = float(case["C"])
    for step in sorted(steps):
        if step in case.get("skipped_steps", ()):  # steps DeepSpeed skipped (an fp16 overflow): no update
            continue
        idx = torch.tensor(sorted(steps[step]), dtype=torch.long)
        if len(idx) == 0:  # an empty logical batch: a noise-only step, zero here (σ = 0)
            continue
        if case["model"] in LOOP_ORACLE:
            def loss_of(m, sel, dtype, xs=x[idx], ys=y[idx]):
                out = nn.functional.cross_entropy(m(xs[sel]), ys[sel], reduction="none")
                return out.reshape(len(sel), -1).mean(1)  # per example: the mean over its tokens
            grads = loop_per_example_grads(model, loss_of, len(idx))
        else:
            oracle = per_example_grads_loop if case.get("oracle") == "loop" else per_example_grads
            grads = oracle(model, nn.functional.cross_entropy, x[idx], y[idx])
        if case.get("users"):  # user-level DP: each user's mean gradient is the unit clipped
            grads = unit_means(grads, [case["users"][i] for i in idx.tolist()])
        groups = None
        if case["clipping"] == "group-wise":
            import fnmatch

            pats = case["opt_groups"] if case["clipping_groups"] == "param_groups" else case["clipping_groups"]
            groups = [[n for n in grads if any(fnmatch.fnmatchcase("net." + n, s) for s in g)] for g in pats]
        summed = clipped_sum(model, grads, C, case["clipping"], case["clipping_fn"], groups=groups)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in summed:  # (frozen parameters have no gradient)
                    p -= case["lr"] * (summed[n] / b_exp).float()
    return {f"net.{k}": v.detach().clone() for k, v in model.named_parameters()}


def check_bf16_against_oracle(case, result):
    """A bf16-mixed run's final parameters are the oracle's to a few bf16 ulps of weights of magnitude ~1, and
    clipping changed the update far more than bf16 rounding did (the comparison is not vacuous)."""
    exp = expected_params(case, result)
    unclipped = expected_params(dict(case, C=float("inf")), result)
    err = max((result["final"][k] - exp[k]).abs().max().item() for k in exp)
    gap = max((unclipped[k] - exp[k]).abs().max().item() for k in exp)
    assert err < 1.2e-2, case["name"]
    assert gap > 4 * err, case["name"]


def check_noise_std(case, result, world_size):
    """I3: with zero per-example gradients the update is lr × noise; its std over every coordinate is σC/B_exp
    (B_exp = batch × W × accumulation) to 3% (~33k coordinates: a √2 error, noise twice or averaged, fails), its
    mean is near 0, and every rank ends with the same parameters."""
    b_exp = case["batch_size"] * world_size * case["accumulate"]
    assert result["plan"]["expected_batch_size"] == pytest.approx(b_exp)
    delta = torch.cat([(result["final"][k] - result["init"][k]).flatten() for k in result["final"]]) / case["lr"]
    expected_std = case["sigma"] * case["C"] / b_exp
    assert delta.std().item() == pytest.approx(expected_std, rel=0.03), case["name"]
    assert abs(delta.mean().item()) < 4 * expected_std / math.sqrt(delta.numel()), case["name"]
    for r in range(1, world_size):
        for k in result["final"]:
            torch.testing.assert_close(result["final_rank"][r][k], result["final"][k], rtol=0, atol=0)
