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
                        row("gpt/zero3/layer", "layer", cpu_ratio_layer),
                        dict(row("gpt/zero3/all-2pass", "all-2pass", 1.5, 1.3), alloc_step_peak_ratio=1.04)]}


def test_targets_give_verdicts_only_for_what_ran():
    text = report.targets(_st(1.27, 1.29))
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()}
    assert "| met |" in lines["all-layer, GPT d 256 (T 128, 4 blocks, micro-batch 8), ZeRO-3"]  # 1.27 <= 1.28
    assert "**missed**" in lines["layer-wise, GPT d 256 (T 128, 4 blocks, micro-batch 8), ZeRO-3"]  # 1.29 > 1.28
    assert report.NOT_RUN in lines["all-layer, GPT d 256 (T 128, 4 blocks, micro-batch 8), ZeRO-2"]
    assert "met" in lines["all-layer peak memory growth, book-keeping, gpt/zero3/all"]  # RSS growth 1.05
    # where the allocator's step peak was measured, the verdict is on it (1.04), not on the RSS growth (1.3)
    two_pass = lines["all-layer peak memory growth, two-pass, gpt/zero3/all-2pass"]
    assert "step peak ×1.040; RSS growth ×1.300" in two_pass and "| met" in two_pass
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


def test_verdicts_use_the_interleaved_ratio_where_it_ran():
    st = _st(1.50, 1.20)  # the separate launches: all-layer far above its bound
    st["results"][0].update(paired_cpu_ratio=1.27, paired_time_ratio=1.27, paired_cpu_quartiles=[1.25, 1.30])
    line = next(line for line in report.targets(st).splitlines()
                if line.startswith("| all-layer, GPT d 256 (T 128, 4 blocks, micro-batch 8), ZeRO-3"))
    assert "1.270 (quartiles 1.25–1.30)" in line and "| met |" in line
    assert report.cpu_ratio(st["results"][1]) == 1.20  # no interleaved run: the separate launch's


def test_baton_lets_participants_run_one_at_a_time_in_turn():
    """Three threads take turns; one leaves after two turns and is skipped from then on."""
    import threading

    from benchmarks.interleave import Baton

    baton, order, lock = Baton(3), [], threading.Lock()
    running = [0]

    def work(i, turns):
        baton.wait(i)
        for t in range(turns):
            with lock:
                running[0] += 1
                assert running[0] == 1  # nobody else holds the baton
                order.append(i)
                running[0] -= 1
            if t < turns - 1:
                baton.pass_on(i)
                baton.wait(i)
        baton.leave(i)

    threads = [threading.Thread(target=work, args=(i, n)) for i, n in enumerate((3, 2, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert order == [0, 1, 2, 0, 1, 2, 0, 2]


def test_single_interleaved_times_every_method_every_round():
    from benchmarks.interleave import single_interleaved

    case = dict(model="cnn", model_kw=dict(channels=8, image=8, classes=3), batch=4, warmup=1, steps=2,
                threads=1, accelerator="cpu", seed=0)
    out = single_interleaved({"warmup": 1, "steps": 2, "cases": [
        dict(case, name="cnn/1proc/nondp", method="nondp"), dict(case, name="cnn/1proc/ours-layer",
                                                                  method="ours-layer")]})
    assert {k: len(v) for k, v in out["cpu_s"].items()} == {"cnn/1proc/nondp": 3, "cnn/1proc/ours-layer": 3}
    assert all(t > 0 for v in out["step_s"].values() for t in v)
    assert {k: len(v) for k, v in out["faults"].items()} == {"cnn/1proc/nondp": 3, "cnn/1proc/ours-layer": 3}


def test_the_page_says_how_many_page_faults_the_interleaved_steps_paid():
    from benchmarks.run import _faults_sentence

    st = {"results": [{"paired_faults_per_step": 3.0, "paired_baseline_faults_per_step": 12.5}, {}]}
    assert "at most 12 minor page faults" in _faults_sentence(st)
    assert _faults_sentence({"results": [{}]}) == "This run did not count page faults."


@pytest.mark.slow
def test_a_lightning_group_runs_interleaved_on_two_ranks(tmp_path):
    """Lightning's DeepSpeedStrategy and DPDeepSpeedStrategy fit in threads of the same two processes, taking
    turns step by step (ZeRO-2): every round of both is timed, and the paired ratio comes back."""
    from benchmarks.interleave import run_group
    from benchmarks.step_time import lightning_case

    common = dict(model="cnn", model_kw=dict(channels=8, image=8, classes=3), stage=2, world=2, batch=4,
                  warmup=1, steps=3)
    cases = [lightning_case("cnn/zero2", "nondp", **common),
             lightning_case("cnn/zero2", "layer", clipping="layer-wise", clipping_fn="abadi", **common)]
    out = run_group(cases, tmp_path, timeout=300)
    assert "error" not in out, out.get("log_tail")
    paired = out["cnn/zero2/layer"]
    assert paired["paired_rounds"] == 3 and len(paired["paired_baseline_cpu_s"]) == 3
    assert 0 < paired["paired_cpu_ratio"] < 100
    # every step's page faults are counted (the trainer threads share the main heap: STEADY_MALLOC)
    assert paired["paired_faults_per_step"] >= 0 and paired["paired_baseline_faults_per_step"] >= 0


def test_the_largest_model_search_measures_one_training_step_and_no_profiled_one():
    from benchmarks.ds_worker import takes_memory_step
    from benchmarks.step_time import lightning_case

    for method, offload in (("nondp", False), ("all-2pass", True)):
        cfg = largest_model.trial_config(_args(), "ZeRO-3", 3, method, 64, offload)
        assert cfg["warmup"] + cfg["steps"] == 1 and not takes_memory_step(cfg)
    assert cfg["clipping_mode"] == "two-pass" and cfg["strategy_kw"]["offload_optimizer"]
    # the step-time runs keep their profiled memory step
    step = lightning_case("gpt/zero2", "all", model="gpt", model_kw={}, stage=2, world=2, batch=8, warmup=2,
                          steps=5)
    assert takes_memory_step(step)


def test_timed_workers_run_with_a_steady_allocator_and_the_memory_search_with_the_default():
    """Timings without glibc's page-fault churn (``STEADY_MALLOC``); the largest-model budget with the allocator a
    user runs."""
    from benchmarks.common import STEADY_MALLOC
    from benchmarks.launch import worker_env
    from benchmarks.step_time import lightning_case

    step = lightning_case("gpt/zero2", "all", model="gpt", model_kw={}, stage=2, world=2, batch=8, warmup=2,
                          steps=5)
    env = worker_env(step, 1, 2, 12345)
    assert {k: env[k] for k in STEADY_MALLOC} == STEADY_MALLOC and env["RANK"] == "1"
    trial = largest_model.trial_config(_args(), "ZeRO-3", 3, "nondp", 64, False)
    env = worker_env(trial, 0, 2, 12345)
    assert all(env.get(k) == os.environ.get(k) for k in STEADY_MALLOC)


def test_the_largest_model_table_and_targets_show_two_pass_where_it_was_searched():
    lm = {"args": {"budget_mb": 2048.0, "world": 2}, "footprint_mb": 480.0, "configs": [{
        "label": "ZeRO-3 + offload", "stage": 3, "predicted_d": 64, "formula_psi": 100,
        "results": {"nondp": {"d": 64, "psi": 100, "peak_rss_mb": 2000.0}, "all": {"d": 32, "psi": 90,
                    "peak_rss_mb": 1990.0}, "all-2pass": {"d": 64, "psi": 100, "peak_rss_mb": 2010.0}}}]}
    table = largest_model.render(lm)
    assert "all-layer two-pass: d / Ψ / peak RSS MB" in table and "layer-wise" not in table
    rows = report.targets(None, largest=[None, lm]).splitlines()  # a first search that was not run
    two_pass = next(line for line in rows if "all-layer two-pass against non-DP, ZeRO-3 + offload" in line)
    book = next(line for line in rows if "all-layer against non-DP, ZeRO-3 + offload" in line)
    assert "1.000" in two_pass and "| met |" in two_pass
    assert "0.900" in book and "**missed**" in book
    # the same stage searched twice: the second search's rows say so, the first's do not
    rows = report.targets(None, largest=[lm, lm]).splitlines()
    assert sum("ZeRO-3 + offload, 2048 MB per process |" in line for line in rows) == 2
    assert sum("ZeRO-3 + offload, 2048 MB per process, a later search |" in line for line in rows) == 2


def test_a_profile_says_host_time_and_the_gpu_section_shows_it_only_where_measured():
    """``summarize`` reports the GPU's busy time only when the GPU was profiled (never a zero that reads as
    "no GPU work"), and the page's GPU section gains its profile table only from profiles that ran."""
    import copy
    import json
    from pathlib import Path

    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import gpu
    from benchmarks.profile_engine import summarize

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with torch.profiler.record_function("step"), torch.profiler.record_function("dpzero.engine._on_backward"):
                torch.randn(64, 64) @ torch.randn(64, 64)
    p = summarize(prof, steps=2)
    assert p["profiled_step_ms"] > 0 and "dpzero.engine._on_backward" in p["labels_ms"]
    assert "device_ms_per_step" not in p and "no GPU kernels" in gpu.profile_line(p)
    assert gpu.profile_line({"error": "timeout"}) == "failed: timeout"

    committed = json.loads((Path(gpu.__file__).parent / "results" / "step_time_gpu.json").read_text())
    assert "Where the step's time goes" not in gpu.render_section(committed)
    with_profiles = copy.deepcopy(committed)
    with_profiles["runs"][-1]["profiles"] = {
        "gpt/zero3/all": dict(p, device_ms_per_step=12.5, kernels_per_step=900.0),
        "gpt/zero3/layer": {"error": "timeout"}}
    page = gpu.render_section(with_profiles)
    table = page.split("### Where the step's time goes")[1].split("### Run 1")[0]
    assert "| gpt/zero3/all | " in table and "| 12.5 | 900 |" in table and "gpt/zero3/layer" not in table


def test_the_benchmarks_pages_are_what_the_committed_results_render(tmp_path, monkeypatch):
    """``python -m benchmarks.run --render-only`` writes the committed pages and plot: a one-screen summary for
    users (the cost on the CPU and the GPU, against Opacus, the plot, no maintainer note in view) and the method
    and history page, both in the site's navigation; the plot's axis caption inside the image."""
    import re
    from pathlib import Path

    from benchmarks import run

    root = Path(__file__).resolve().parents[1]
    summary, method = tmp_path / "benchmarks.md", tmp_path / "benchmarks-method.md"
    png = tmp_path / "results" / run.PNG.name
    monkeypatch.setattr(run, "DOC", summary)
    monkeypatch.setattr(run, "METHOD_DOC", method)
    monkeypatch.setattr(run, "PNG", png)
    monkeypatch.setattr(run, "ROOT", tmp_path)
    run.main(["--render-only"])
    assert summary.read_text() == (root / "docs" / "benchmarks.md").read_text(), "re-render docs/benchmarks.md"
    assert method.read_text() == (root / "docs" / "benchmarks-method.md").read_text(), "re-render the method page"

    page = summary.read_text()
    visible = re.sub(r"<!--.*?-->", "", page, flags=re.S)
    assert "do not edit" not in visible.lower() and "Generated by" not in visible and "MALLOC_" not in visible
    assert len(visible.split()) < 600, len(visible.split())  # one screen, not the method's 12,000 words
    for what in ("CPU, ZeRO-", "NVIDIA H200", "Opacus 1.6 hooks", "](../benchmarks/results/step_time_cpu.png)",
                 "](benchmarks-method.md)"):
        assert what in page, what
    assert "## Summary" in method.read_text() and "## Machine" in method.read_text()
    nav = (root / "mkdocs.yml").read_text()
    assert "benchmarks.md" in nav and "benchmarks-method.md" in nav

    import matplotlib.image

    # nothing is drawn up to the image's edges (the x-axis caption ran past the right edge, cut off), and the
    # caption is there, at the bottom
    image = matplotlib.image.imread(str(png))[:, :, :3]
    edges = {"top": image[:4], "bottom": image[-4:], "left": image[:, :4], "right": image[:, -4:]}
    assert not [side for side, pixels in edges.items() if (pixels < 0.9).any()], "text cut off at the image's edge"
    assert (image[-30:-4] < 0.5).any(), "no caption under the x axis"


def test_mechanism_specs_are_dp_sgd_or_name_colon_positive_integer():
    from benchmarks.correlated_noise import parse_mechanism

    assert parse_mechanism("dp-sgd") == ("dp-sgd", None)
    assert parse_mechanism("banded-mf:4") == ("banded-mf", 4)
    assert parse_mechanism("blt:12") == ("blt", 12)
    for bad in ("banded-mf", "banded-mf:", "banded-mf:0", ":4", "banded-mf:x"):
        with pytest.raises(ValueError, match="NAME:K"):
            parse_mechanism(bad)


def test_correlated_noise_sweeps_merge_by_epsilon_mechanism_and_seed(tmp_path):
    import json

    from benchmarks.correlated_noise import sweep

    out, header = tmp_path / "r.json", {"benchmark": "b", "model": "m", "setting": {"epochs": 3}}
    calls = []

    def run(eps, seed, name, bands, offset=0.0):
        calls.append((eps, seed, name, bands))
        return {"accuracy": eps / 10 + seed / 100 + (bands or 0) / 1000 + offset, "sigma": 1.0 / eps}

    sweep(run, [1.0, 2.0], ["dp-sgd"], 2, out, header)
    sweep(run, [1.0], ["banded-mf:4"], 3, out, header)  # a new mechanism: the dp-sgd rows stay
    assert calls[-3:] == [(1.0, s, "banded-mf", 4) for s in range(3)]
    n = len(calls)
    sweep(run, [1.0, 2.0], ["dp-sgd", "banded-mf:4"], 2, out, header)  # a rerun skips what the file holds
    assert calls[n:] == [(2.0, 0, "banded-mf", 4), (2.0, 1, "banded-mf", 4)]
    result = sweep(lambda *a: run(*a, offset=0.5), [2.0], ["dp-sgd"], 1, out, header, redo=True)  # redo one seed
    assert result == json.loads(out.read_text())
    rows = {(r["target_epsilon"], r["mechanism"]): r for r in result["rows"]}
    assert list(rows) == [(1.0, "dp-sgd"), (1.0, "banded-mf:4"), (2.0, "dp-sgd"), (2.0, "banded-mf:4")]
    assert [r["seed"] for r in rows[2.0, "dp-sgd"]["runs"]] == [0, 1]
    assert rows[2.0, "dp-sgd"]["accuracy_mean"] == pytest.approx((0.7 + 0.21) / 2)
    assert rows[1.0, "banded-mf:4"]["accuracy_std"] == pytest.approx(0.01 * (2 / 3) ** 0.5)
    assert (rows[1.0, "banded-mf:4"]["noise_mechanism"], rows[1.0, "banded-mf:4"]["bands"]) == ("banded-mf", 4)
    with pytest.raises(ValueError, match="another setting"):  # runs of another setting do not mix into one table
        sweep(run, [1.0], ["dp-sgd"], 1, out, {**header, "setting": {"epochs": 4}})
    with pytest.raises(ValueError, match="NAME:K"):  # a bad spec fails before any run
        n = len(calls)
        sweep(run, [1.0], ["dp-sgd", "banded-mf"], 1, out, header)
    assert len(calls) == n
