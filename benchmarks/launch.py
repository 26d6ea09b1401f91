"""Launch one benchmark configuration in fresh processes and merge what its ranks report.

A configuration (a dict, see ``benchmarks.step_time.build_cases``) runs as ``cfg['world']`` processes for
Lightning + DeepSpeed (``kind == "lightning"``, the ``torchrun`` environment set here so Lightning does not
relaunch) or one process otherwise, each ``python -m benchmarks.step_time --worker CFG --result RES``.
With ``rss_limit_mb`` a watchdog reads every rank's resident set (``VmRSS``) ten times a second and kills
the configuration once one rank crosses it (the memory budget of ``benchmarks.largest_model``). Workers run
with :data:`~benchmarks.common.STEADY_MALLOC` unless ``cfg['default_malloc']`` is true.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks.common import STEADY_MALLOC, median

ROOT = Path(__file__).resolve().parent.parent
#: worker kinds that run as one process (the others run ``cfg['world']`` ranks)
ONE_PROCESS = ("single", "interleaved-single")


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _warn_stale_build_locks() -> None:
    """Killing a DeepSpeed CPU worker while it holds torch's extension-build lock leaves the lock file
    behind, and every later DeepSpeed CPU launch on the machine (anyone's) then waits on it forever.
    Say so; removing it is left to a person who can see that no build is running."""
    for lock in Path.home().glob(".cache/torch_extensions/*/*/lock"):
        print(f"WARNING: {lock} exists after killing a worker; if no compiler is running, remove it, or "
              "every DeepSpeed CPU launch on this machine waits on it.", flush=True)


def worker_env(cfg: dict, rank: int, n: int, port: int) -> dict:
    """The environment of rank ``rank`` of ``n``: the ``torchrun`` variables, ``cfg['threads']`` OpenMP threads,
    and :data:`~benchmarks.common.STEADY_MALLOC` unless ``cfg['default_malloc']``."""
    malloc = {} if cfg.get("default_malloc") else STEADY_MALLOC
    return dict(os.environ, **malloc, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n),
                RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(n),
                OMP_NUM_THREADS=str(cfg["threads"]), PYTHONWARNINGS="ignore",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_ranks(cfg: dict, logdir: Path, timeout: float, rss_limit_mb: Optional[float] = None) -> tuple:
    """Run one worker configuration in fresh processes (``cfg['world']`` ranks unless ``cfg['kind']`` is a
    one-process kind); returns ``(ranks, extra)``: every rank's result dict (None on failure) and the launch's
    facts (``launch_wall_s``, ``rss_seen_mb``: the largest ``VmRSS`` the watchdog saw per rank, sampled; and
    on failure ``error`` with ``log_tail``, ``over_budget: True`` when the watchdog killed it for crossing
    ``rss_limit_mb`` MB in one rank)."""
    tag = cfg["name"].replace("/", "_")
    cfg_path = logdir / f"{tag}.json"
    cfg_path.write_text(json.dumps(cfg))
    n = 1 if cfg["kind"] in ONE_PROCESS else cfg["world"]
    procs, logs = [], []
    for attempt in range(2):
        port = _free_port()
        procs, logs = [], []
        for rank in range(n):
            env = worker_env(cfg, rank, n, port)
            log = logdir / f"{tag}.rank{rank}.log"
            logs.append(log)
            res = logdir / f"{tag}.rank{rank}.result.json"
            if res.exists():
                res.unlink()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.step_time", "--worker", str(cfg_path), "--result", str(res)],
                cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT))
        t0 = time.time()
        codes, first_fail, over, seen = [None] * n, None, False, [0.0] * n
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if first_fail is None and any(c not in (None, 0) for c in codes):
                first_fail = time.time()  # e.g. rank 0 lost the port race: the others would wait for it
            if rss_limit_mb is not None:
                seen = [max(s, _rss_mb(p.pid)) for s, p in zip(seen, procs)]
                over = max(seen) > rss_limit_mb
            if over or (first_fail is not None and time.time() - first_fail > 30) or time.time() - t0 > timeout:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                _warn_stale_build_locks()
                codes = [p.returncode if c is None or c == 0 else c for p, c in zip(procs, codes)]
                codes = [c if c is not None else "killed" for c in codes]
                if time.time() - t0 > timeout:
                    codes.append("timeout")
                break
            time.sleep(0.1 if rss_limit_mb is not None else 0.5)
        text = "\n".join(log.read_text(errors="replace")[-4000:] for log in logs)
        if any(codes) and "address already in use" in text.lower() and attempt == 0:
            continue  # lost the race for the rendezvous port: once more
        break
    wall = time.time() - t0
    extra = {"launch_wall_s": wall, "rss_seen_mb": seen}
    if over:
        return None, {"error": f"over the memory budget of {rss_limit_mb:.0f} MB per process (killed)",
                      "over_budget": True, "log_tail": text[-1500:], **extra}
    if any(codes):
        return None, {"error": f"exit codes {codes}", "log_tail": text[-3000:], **extra}
    return [json.loads((logdir / f"{tag}.rank{r}.result.json").read_text()) for r in range(n)], extra


def launch(cfg: dict, logdir: Path, timeout: float, rss_limit_mb: Optional[float] = None) -> dict:
    """Run one configuration (:func:`run_ranks`) and merge its ranks: a step's time is the slowest rank's,
    its CPU time the sum over ranks, medians over the timed steps; or ``{"error": ...}`` as :func:`run_ranks`."""
    ranks, extra = run_ranks(cfg, logdir, timeout, rss_limit_mb)
    if ranks is None:
        return extra
    steps = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    timed = steps[cfg["warmup"]:]
    cpu = [sum(r["cpu_s"][i] for r in ranks) for i in range(len(ranks[0]["cpu_s"]))][cfg["warmup"]:]
    out = {"median_s": median(timed), "step_s": timed, "warmup_s": steps[:cfg["warmup"]],
           "cpu_median_s": median(cpu), "cpu_s": cpu,
           "rss_peak_mb": [r["rss_peak"] / 2**20 for r in ranks],
           "rss_base_mb": [r["rss_base"] / 2**20 for r in ranks],
           "rss_growth_mb": [(r["rss_peak"] - r["rss_base"]) / 2**20 for r in ranks],
           "model_states": ranks[0].get("model_states"), **extra,
           "worker_s": max(r.get("worker_s", 0.0) for r in ranks),
           "setup_s": max(r.get("setup_s", 0.0) for r in ranks)}
    if ranks[0].get("profile"):
        out["profile_rank0"] = ranks[0]["profile"]
    if "alloc_peak" in ranks[0]:
        out["alloc_step_peak_mb"] = [r["alloc_peak"] / 2**20 for r in ranks]
    if "cuda_peak" in ranks[0]:
        out["cuda_peak_mb"] = [r["cuda_peak"] / 2**20 for r in ranks]
    return out
