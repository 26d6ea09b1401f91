"""Peak CPU memory of a call, from the allocator's own events (deterministic, unlike the process's RSS)."""

import torch
from torch.profiler import ProfilerActivity, profile


def peak_cpu_bytes(fn) -> int:
    """The highest number of bytes allocated by PyTorch's CPU allocator during ``fn()`` above what was allocated
    when it started (every allocation and free is an event of the profiler's memory record)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    now = peak = 0
    for _, nbytes in events:
        now += nbytes
        peak = max(peak, now)
    return peak
