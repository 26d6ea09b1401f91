"""The multi-process harness reports a failed worker, and tells it apart from one that gloo aborts at exit;
script runs are tried once more (gloo_exit.py)."""

import textwrap

import pytest

from harness import run_cases

WORKER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    rank, out_dir = os.environ["RANK"], sys.argv[2]
    if {marker}:
        Path(out_dir, f"done{{rank}}").touch()
    if rank == "1":
        os.abort()  # SIGABRT, as gloo's teardown rarely does to a rank whose peer has exited
""")


@pytest.mark.parametrize("finished", [True, False])
def test_a_rank_aborted_after_finishing_every_case_passes_and_one_aborted_before_fails(tmp_path, finished):
    worker = tmp_path / "abort_worker.py"
    worker.write_text(WORKER.format(marker=finished))
    if finished:
        assert run_cases([], tmp_path / "out", world_size=2, timeout=60, worker=str(worker)) == {}
    else:
        with pytest.raises(RuntimeError, match=r"worker exit codes \[0, -6\]"):
            run_cases([], tmp_path / "out", world_size=2, timeout=60, worker=str(worker))


def test_a_script_run_is_tried_once_more_and_its_first_failure_is_warned():
    import subprocess

    from gloo_exit import run_with_one_retry

    codes = iter([-6, 0])
    proc = lambda code: subprocess.CompletedProcess([], code, stdout="", stderr="terminate called")  # noqa: E731
    with pytest.warns(UserWarning, match=r"(?s)demo.py failed once, then passed:\nexit -6"):
        assert run_with_one_retry(lambda: proc(next(codes)), "demo.py").returncode == 0
    codes = iter([1, 2])
    assert run_with_one_retry(lambda: proc(next(codes)), "demo.py").returncode == 2  # twice: the second reported
