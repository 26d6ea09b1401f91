"""The benchmark tools' own logic (no benchmark is run here: performance is measured, never asserted).

The largest-model search must find the largest fitting width for any monotone limit, counting parameters
as the model has them; the watchdog must see a process's resident memory; the target table must give a
verdict only for what was measured.
"""

from __future__ import annotations

import argparse
import os

import pytest

from benchmarks import largest_model, report
from benchmarks.launch import _rss_mb
from benchmarks.models import build_model, param_count


def _args(**kw):
    base = dict(seq=64, layers=2, budget_mb=2048.0, world=2, batch=2, timeout=10.0, out=os.devnull)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("d,layers,seq", [(32, 1, 16), (64, 2, 64), (96, 3, 32)])
def test_psi_of_counts_the_models_parameters(d, layers, seq):
    a = _args(layers=layers, seq=seq)
    assert largest_model.psi_of(d, a) == param_count(build_model("gpt", **largest_model.model_kw(d, a)))


@pytest.mark.parametrize("limit", [32, 33 * 32, 40 * 32, 47 * 32, 64 * 32, 90 * 32])
@pytest.mark.parametrize("start,grow", [(40 * 32, 1.08), (64 * 32, 1.08), (40 * 32, 1.0)])
def test_search_finds_the_largest_fitting_width(limit, start, grow):
    search = largest_model.Search(_args(), None, {"trials": []})
    tried = []

    def trial(label, stage, method, d, offload):
        tried.append(d)
        return {"d": d, "fits": d <= limit, "error": None if d <= limit else "over the memory budget",
                "peak_rss_mb": 1.0}

    search.trial = trial
    best = search.largest("ZeRO-0", 0, "nondp", start, grow)
    assert best["d"] == limit
    assert len(tried) == len(set(tried)), "a width was tried twice"
    assert limit + 32 in tried, "the width above the result was not shown not to fit"


def test_search_stops_when_even_a_tiny_model_fails_for_another_reason():
    search = largest_model.Search(_args(), None, {"trials": []})
    search.trial = lambda *a: {"d": a[3], "fits": False, "error": "exit codes [1, 1]", "peak_rss_mb": None}
    assert search.largest("ZeRO-0", 0, "layer", 4 * 32, 1.0) is None


def test_watchdog_reads_resident_memory():
    mb = _rss_mb(os.getpid())
    assert 10 < mb < 1e6
    assert _rss_mb(2**22 + 12345) == 0.0  # no such process


def _st(cpu_ratio_all, cpu_ratio_layer):
    def row(name, method, ratio, growth=1.0):
        return {"name": name, "method": method, "kind": "lightning", "cpu_ratio": ratio, "time_ratio": ratio,
                "rss_growth_ratio": growth, "rss_peak_ratio": 1.0, "cpu_median_s": ratio, "median_s": ratio}
    return {"args": {"d_model": 256, "seq": 128, "layers": 4, "batch": 8}, "facts": {"gpt": {"floor": 1.25}},
            "results": [row("gpt/zero3/all", "all", cpu_ratio_all, 1.05),
                        row("gpt/zero3/layer", "layer", cpu_ratio_layer)]}


def test_targets_give_verdicts_only_for_what_ran():
    text = report.targets(_st(1.27, 1.29))
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()}
    assert "| met |" in lines["all-layer, GPT d 256 (T 128, 4 blocks, micro-batch 8), ZeRO-3"]  # 1.27 <= 1.28
    assert "**missed**" in lines["layer-wise, GPT d 256 (T 128, 4 blocks, micro-batch 8), ZeRO-3"]  # 1.29 > 1.28
    assert report.NOT_RUN in lines["all-layer, GPT d 256 (T 128, 4 blocks, micro-batch 8), ZeRO-2"]
    assert "met" in lines["all-layer peak memory growth, gpt/zero3/all"]
    assert report.NOT_RUN in lines["reported ε against the tightest valid bound"]
    assert report.NOT_RUN in lines["largest model that fits, DP against non-DP"]


def test_largest_model_target_compares_parameter_counts():
    lm = {"args": {"budget_mb": 2048.0}, "configs": [{"label": "ZeRO-2", "results": {
        "nondp": {"psi": 100}, "layer": {"psi": 96}, "all": {"psi": 90}}}]}
    text = report.targets(None, largest=lm)
    layer = next(line for line in text.splitlines() if "layer-wise against non-DP, ZeRO-2" in line)
    all_ = next(line for line in text.splitlines() if "all-layer against non-DP, ZeRO-2" in line)
    assert "0.960" in layer and "| met |" in layer
    assert "0.900" in all_ and "**missed**" in all_
