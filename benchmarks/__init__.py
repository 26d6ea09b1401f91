"""Benchmarks of lightning-dpzero: per-layer micro-benchmarks and whole-step times.

Entry points::

    python -m benchmarks.run                 # everything on the CPU; renders docs/benchmarks*.md + PNG
    python -m benchmarks.per_layer --help    # per-layer micro-benchmark only
    python -m benchmarks.step_time --help    # whole-step times only
    bash benchmarks/gpu.sh [--smoke]         # the prepared one-GPU run (d 768); --smoke on the CPU
"""
