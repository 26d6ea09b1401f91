"""Launch ``crash_worker.py`` on W CPU processes like torchrun, and stop the job as torchrun does: when one
rank dies, the others are killed (SIGKILL) after a short grace period. Optionally kill a random rank at a
random moment of the training."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cases, out_dir, world_size=2, timeout=300, random_kill=None, grace=2.0, sigterm=None):
    """Run ``cases`` on ``world_size`` ranks. ``random_kill = (rng, started_file, max_delay_s)``: once
    ``started_file`` exists, wait uniform(0, max_delay_s) and SIGKILL a random rank. ``sigterm = (started_file,
    delay_s)``: that long after ``started_file`` exists, SIGTERM the ranks' process group (what a cluster
    scheduler does on preemption); a job still running ``timeout`` seconds after the start is SIGKILLed.

    Returns ``{"codes": [...], "killed": (rank, delay) or None, "log": rank0 log tail, "sigterm_to_exit": seconds
    from the SIGTERM until the last rank exited (None without one)}``; a negative code is the signal that ended
    the rank."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = out_dir / f"cases{random.getrandbits(32):08x}.json"
    cfg.write_text(json.dumps(cases))
    for _ in range(3):
        res = _launch_once(cfg, out_dir, world_size, timeout, random_kill, grace, sigterm)
        # only a lost race for the rendezvous port is retried
        if not any(res["codes"]) or "address already in use" not in res["log"].lower():
            return res
    return res


def _launch_once(cfg, out_dir, world_size, timeout, random_kill, grace, sigterm=None):
    port = _free_port()
    procs, logs, group = [], [], {"process_group": 0}  # a process group of the job's own
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                   RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(world_size),
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        log_path = out_dir / f"{cfg.stem}.rank{rank}.log"
        logs.append(log_path)
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(HERE / "crash_worker.py"), str(cfg), str(out_dir)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT, **group))
        group = {"process_group": procs[0].pid}  # every rank in the first one's new process group
    start, killed, kill_at, first_death, term_at = time.monotonic(), None, None, None, None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if sigterm is not None and term_at is None and Path(sigterm[0]).exists():
            time.sleep(sigterm[1])
            term_at = time.monotonic()
            os.killpg(procs[0].pid, signal.SIGTERM)
        if random_kill is not None and killed is None:
            rng, started, max_delay = random_kill
            if kill_at is None and Path(started).exists():
                delay = rng.uniform(0, max_delay)
                kill_at, killed_rank = now + delay, rng.randrange(world_size)
            if kill_at is not None and now >= kill_at and procs[killed_rank].poll() is None:
                procs[killed_rank].send_signal(signal.SIGKILL)
                killed = (killed_rank, round(delay, 3))
        if first_death is None and any(c not in (None, 0) for c in codes):
            first_death = now
        if (first_death is not None and now - first_death > grace and term_at is None) or now - start > timeout:
            for p in procs:  # torchrun stops the whole group once a worker failed
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
        time.sleep(0.05)
    codes = [p.wait() for p in procs]
    return {"codes": codes, "killed": killed, "log": logs[0].read_text()[-6000:],
            "sigterm_to_exit": time.monotonic() - term_at if term_at is not None else None}


def results(out_dir, name, world_size=2):
    """Every rank's ``<name>.rank<r>.json`` (None for a rank that died before writing it)."""
    out = []
    for r in range(world_size):
        f = Path(out_dir) / f"{name}.rank{r}.json"
        out.append(json.loads(f.read_text()) if f.exists() else None)
    return out
