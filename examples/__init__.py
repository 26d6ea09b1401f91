"""The examples, importable as ``examples.<name>`` from the repository root (the configs in
``examples/configs`` name their classes that way, e.g. ``examples.shakespeare_gpt.CharGPT``).

A regular package on purpose: some installed distributions (opacus 1.6, for one) ship a top-level
``examples`` package into site-packages, which would shadow a namespace package of that name.
"""
