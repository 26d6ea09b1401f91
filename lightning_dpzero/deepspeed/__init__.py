"""Where the DP step meets DeepSpeed's internals: the ZeRO-3 trace (``zero3_trace.py``), the coalesced
reduction of deferred clipped sums (``reduction.py``), how Lightning starts DeepSpeed on CPU and under DeepSpeed's
launcher (``launch.py``), and the build of DeepSpeed's CPU op (``extensions.py``) (docs/design.md, *Layout*)."""
