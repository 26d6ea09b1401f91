"""Shared helpers: timing, memory (profiler peak, RSS high-water mark), machine description, tables."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

RESULTS = Path(__file__).parent / "results"
#: DP methods the largest-model search may run, with the words of their columns and target rows
LARGEST_DP_METHODS = {"layer": "layer-wise", "all": "all-layer", "all-2pass": "all-layer two-pass"}
#: σ and C of every DP configuration of the step-time benchmarks
SIGMA, CLIP = 1.0, 1.0
#: glibc malloc settings of every timed worker (``benchmarks.launch``; not the largest-model search, whose
#: memory budget is measured with the default allocator a user runs). By default glibc serves allocations above
#: 128 KB (adapting up to 32 MB) with fresh ``mmap`` pages and returns freed heap tops to the kernel, so a
#: step's large tensors are page-faulted in again on every step: measured on the benchmark CNN, 11-13
#: thousand minor faults per non-DP step alone, 1.5 thousand when peers' allocations had left the heap grown,
#: i.e. a method's time depended on which others ran in the same process. With these two settings no step
#: faults after warm-up, non-DP and DP alike, and the ratios measure the arithmetic. The third keeps every thread
#: on the process's main heap: the interleaved runs (``benchmarks.interleave``) train each method in a thread of
#: its own, and glibc gives a thread its own arena, whose heap it shrinks back to the kernel whatever the trim
#: threshold; measured on the LoRA configuration, a DP method's thread then paid 5-11 thousand minor faults a
#: step on one rank in about half the launches (15-20 ms of a 200 ms step, interleaved ratio 1.07 against
#: 1.03), where a user's one training thread pays none. Users on the CPU can set the same variables; on a GPU
#: the caching allocator already does this.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**36), "MALLOC_ARENA_MAX": "1"}


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else float("nan")


def time_reps(fn: Callable[[], object], warmup: int, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def profiler_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of live torch CPU tensor bytes allocated during ``fn`` (above what was live before it).

    From ``torch.profiler`` memory events (``profile_memory=True``): every allocation and free of the
    CPU allocator, summed in time order. Counts tensors only (no Python objects, no allocator slack).
    """
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return profiled_peak_bytes(prof)


def profiled_peak_bytes(prof) -> int:
    """:func:`profiler_peak_bytes` of a finished ``torch.profiler.profile(profile_memory=True)``."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return int(peak)


@contextlib.contextmanager
def quiet_stderr():
    """Silence file descriptor 2 (the profiler's C++ start/stop lines) for the duration of the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def rss_bytes() -> int:
    """Current resident set size (``VmRSS``)."""
    return _status_kb("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (``echo 5 > /proc/self/clear_refs``); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """RSS high-water mark (``VmHWM``) since process start or the last :func:`reset_peak_rss`."""
    return _status_kb("VmHWM") * 1024


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_info() -> dict:
    """CPU model, cores, memory, load and library versions, for the JSON and the docs."""
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_average": load_average()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    for mod in ("lightning", "deepspeed", "opacus"):
        try:
            from importlib.metadata import version

            info[mod] = version(mod)
        except Exception:  # noqa: BLE001 - absent package
            info[mod] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    info.update(engine_source())
    return info


def engine_source() -> dict:
    """Which lightning_dpzero was measured: its directory, the commit (``BENCH_ENGINE_COMMIT`` or git) and
    whether its files differ from that commit."""
    root = Path(__file__).resolve().parent.parent
    out = {"engine_commit": os.environ.get("BENCH_ENGINE_COMMIT")}
    try:
        import lightning_dpzero

        out["engine_path"] = str(Path(lightning_dpzero.__file__).parent)
    except Exception as e:  # noqa: BLE001 - a missing dependency on a bare machine
        out["engine_path"] = f"not importable: {type(e).__name__}: {e}"
    if out["engine_commit"] is None:
        try:
            run = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True,  # noqa: E731
                                            timeout=10).stdout.strip()
            out["engine_commit"] = run("rev-parse", "--short", "HEAD") or None
            out["engine_dirty"] = bool(run("status", "--porcelain", "lightning_dpzero"))
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table; floats with 3 significant digits."""
    def fmt(v):
        if v is None:
            return "–"
        if isinstance(v, float):
            if v != v:
                return "–"
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")


def close_run(res: dict, out, t_start: float) -> None:
    """Stamp a finished run's results (wall seconds since ``t_start``, the machine after it) and write them."""
    res["wall_s"] = time.time() - t_start
    res["machine_after"] = machine_info()
    write_json(out, res)
