"""Time ratios from steps interleaved on the same processes: DP and its non-DP baseline take turns, step by step.

Why: on this shared VM one core's speed changes by up to 1.5–2× within seconds (another tenant on the host; the
same matrix product timed in a loop on an idle machine goes 68 → 36 ms and back), and each core on its own. Two
launches a minute apart, the method of ``benchmarks.step_time``, then differ by that much: the ratio of two
medians measures the host as much as DP. Here every method of a group (the non-DP baseline first) runs in the
*same* processes, one optimizer step each in turn (round 1: non-DP, layer-wise, all-layer; round 2: the same;
...), and a method's ratio is the median over rounds of its step's CPU time over the baseline's step of the same
round, seconds apart on the same cores. Peak memory cannot be told apart this way (one process holds every
method's model); it comes from the separate launches.

* **Lightning + DeepSpeed** (``kind="interleaved-lightning"``): one ``Trainer`` per method, each ``fit`` in a
  thread of every rank. A baton lets one thread run at a time, passed at every optimizer step's end (after all
  other callbacks, the accountant's included) in a fixed order, so every rank runs the same sequence of
  collectives and a step's CPU time (``time.process_time``: every thread of the process, gloo's included) is
  that method's alone. Each method keeps its own DeepSpeed engine; the process group is shared. Threads would
  each get a glibc arena of their own, which returns freed memory to the kernel as a user's one training thread
  does not: the launch keeps them on one (``MALLOC_ARENA_MAX=1`` of ``STEADY_MALLOC``), and every step's minor
  page faults are counted, so a result shows that none were paid.
* **One process** (``kind="interleaved-single"``): the step functions of ``benchmarks.single_worker`` called in
  turn.

``run_group(cases, ...)`` launches a group and returns per method: ``paired_cpu_ratio`` /
``paired_time_ratio`` (medians over the timed rounds of the per-round ratios), their quartiles, the
per-round values and the median page faults of a step (``paired_faults_per_step``, the baseline's beside it).
"""

from __future__ import annotations

import resource
import threading
import time
from pathlib import Path

from benchmarks.common import median
from benchmarks.launch import run_ranks


class Baton:
    """Lets one of ``n`` participants run at a time, in turn (0, 1, ..., n-1, 0, ...); one that leaves is
    skipped from then on."""

    def __init__(self, n: int):
        self._cv, self._turn, self._active = threading.Condition(), 0, list(range(n))

    def wait(self, i: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._turn == i)

    def _advance(self, i: int, leave: bool) -> None:
        with self._cv:
            k = self._active.index(i)
            if leave:
                self._active.remove(i)
                self._turn = self._active[k % len(self._active)] if self._active else -1
            else:
                self._turn = self._active[(k + 1) % len(self._active)]
            self._cv.notify_all()

    def pass_on(self, i: int) -> None:
        """``i`` yields: the next participant runs (``i`` calls :meth:`wait` to run again)."""
        self._advance(i, leave=False)

    def leave(self, i: int) -> None:
        self._advance(i, leave=True)


def lightning_interleaved(cfg: dict) -> dict:
    """One rank: every case of ``cfg['cases']`` (the baseline first) as a ``Trainer.fit`` in its own thread,
    taking turns step by step. Returns per case its steps' wall and CPU seconds."""
    import lightning as L
    import torch

    from benchmarks.ds_worker import make_trainer

    torch.set_num_threads(cfg["threads"])
    cases, baton = cfg["cases"], Baton(len(cfg["cases"]))
    times = {c["name"]: [] for c in cases}
    cpu = {c["name"]: [] for c in cases}
    faults = {c["name"]: [] for c in cases}
    errors: dict = {}

    class Turn(L.Callback):
        """Yields the baton at training start and after each optimizer step, and times the slice it holds."""

        def __init__(self, i: int, name: str, K: int):
            self.i, self.name, self.K, self.t0, self.c0 = i, name, K, 0.0, 0.0

        def _yield(self):
            baton.pass_on(self.i)
            baton.wait(self.i)
            self.f0 = _minor_faults()
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_train_start(self, trainer, *a):
            self._yield()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % self.K:
                return
            times[self.name].append(time.perf_counter() - self.t0)
            cpu[self.name].append(time.process_time() - self.c0)
            faults[self.name].append(_minor_faults() - self.f0)
            self._yield()

    def run(i: int, case: dict) -> None:
        baton.wait(i)
        try:
            trainer, module = make_trainer(case, [], [Turn(i, case["name"], case.get("accumulate", 1))])
            trainer.fit(module)
        except BaseException as exc:  # noqa: BLE001 - reported; the other ranks' launch times out
            errors[case["name"]] = f"{type(exc).__name__}: {exc}"
        finally:
            baton.leave(i)

    threads = [threading.Thread(target=run, args=(i, c), name=c["name"]) for i, c in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"interleaved run failed: {errors}")
    return {"step_s": times, "cpu_s": cpu, "faults": faults}


def _minor_faults() -> int:
    """Minor page faults of the calling thread so far (of the process where the OS counts no threads' own):
    a step that faults pays for the allocator, not for its arithmetic (``STEADY_MALLOC``)."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def single_interleaved(cfg: dict) -> dict:
    """One process: the step functions of every case of ``cfg['cases']`` called in turn, one step each."""
    from benchmarks.single_worker import build_step

    built = [(c["name"], *build_step(c)) for c in cfg["cases"]]
    times = {name: [] for name, *_ in built}
    cpu = {name: [] for name, *_ in built}
    faults = {name: [] for name, *_ in built}
    for k in range(cfg["warmup"] + cfg["steps"]):
        for name, step, batches, sync in built:
            x, y = batches[k]
            sync()
            f0, t0, c0 = _minor_faults(), time.perf_counter(), time.process_time()
            step(x, y)
            sync()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            faults[name].append(_minor_faults() - f0)
    return {"step_s": times, "cpu_s": cpu, "faults": faults}


def _quartiles(xs: list[float]) -> list[float]:
    xs = sorted(xs)
    if not xs:
        return []
    at = lambda f: xs[min(len(xs) - 1, max(0, round(f * (len(xs) - 1))))]  # noqa: E731
    return [at(0.25), at(0.75)]


def run_group(cases: list[dict], logdir: Path, timeout: float) -> dict:
    """Launch one group's cases interleaved (``cases[0]`` is the non-DP baseline) and return, per DP case,
    the paired ratios over the timed rounds (a round's wall time: the slowest rank's; its CPU time: the sum
    over ranks) and the median minor page faults of a step (a round's: the most of any rank), or
    ``{"error": ...}`` for the group."""
    base = cases[0]
    kind = "interleaved-single" if base["kind"] == "single" else "interleaved-lightning"
    cfg = {"name": base["group"] + "/interleaved", "kind": kind, "world": base["world"],
           "threads": base["threads"], "warmup": base["warmup"], "steps": base["steps"], "cases": cases}
    ranks, extra = run_ranks(cfg, logdir, timeout * len(cases))
    if ranks is None:
        return {"error": extra["error"], "log_tail": extra["log_tail"]}
    w = base["warmup"]
    def rounds(key: str, combine) -> dict[str, list[float]]:
        """Per case, each timed round's value of ``key`` combined over the ranks."""
        return {c["name"]: [combine(r[key][c["name"]][k] for r in ranks)
                            for k in range(len(ranks[0][key][c["name"]]))][w:] for c in cases}

    # a round's wall time: the slowest rank's; its CPU time: the sum over ranks; its faults: the most any rank's
    # step took (every step of every method should take none)
    wall, cpu, faults = rounds("step_s", max), rounds("cpu_s", sum), rounds("faults", max)
    out = {"launch_wall_s": extra["launch_wall_s"]}
    b = base["name"]
    for c in cases[1:]:
        n = c["name"]
        rc = [x / y for x, y in zip(cpu[n], cpu[b])]
        rw = [x / y for x, y in zip(wall[n], wall[b])]
        out[n] = {"paired_cpu_ratio": median(rc), "paired_time_ratio": median(rw),
                  "paired_cpu_quartiles": _quartiles(rc), "paired_time_quartiles": _quartiles(rw),
                  "paired_cpu_s": cpu[n], "paired_baseline_cpu_s": cpu[b], "paired_rounds": len(rc),
                  "paired_faults_per_step": median(faults[n]), "paired_baseline_faults_per_step": median(faults[b])}
    return out
