"""DeepSpeed's CPU communication op (issue #45, item 1): built once per environment, and a start that waits on a
build lock left by a killed run says so, naming the lock and the command that removes it, instead of hanging
silently (``lightning_dpzero.deepspeed.extensions``)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_dpzero.deepspeed.extensions import build_watched

ROOT = Path(__file__).resolve().parents[2]


class _Stream:
    """A text stream that keeps what is written and signals when ``marker`` was."""

    def __init__(self, marker: str) -> None:
        self.text, self.marker, self.seen = "", marker, threading.Event()

    def write(self, text: str) -> int:
        self.text += text
        if self.marker in self.text:
            self.seen.set()
        return len(text)

    def flush(self) -> None:
        pass


def _stale_lock(directory: Path, days: float = 3) -> Path:
    lock = directory / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - days * 86400
    os.utime(lock, (then, then))
    return lock


def test_a_wait_on_a_stale_build_lock_is_reported_once_with_the_fix(tmp_path, monkeypatch, capsys):
    from torch.utils.file_baton import FileBaton

    lock = _stale_lock(tmp_path)
    monkeypatch.setenv("DPZERO_BUILD_LOCK_WARN_S", "0.5")
    err = _Stream(f"rm {lock}")
    monkeypatch.setattr(sys, "stderr", err)
    # a run killed mid-build left the lock: remove it once the message has told us to (or after 60 s, and fail)
    remover = threading.Thread(target=lambda: (err.seen.wait(60), lock.unlink()))
    remover.start()
    with build_watched():
        print("kept line")
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        FileBaton(str(lock)).wait()  # what torch's extension build does while another process holds the lock
    remover.join()
    assert err.seen.is_set(), err.text
    assert err.text.count("lightning_dpzero: waiting") == 1
    assert str(lock) in err.text and "It was created 3 days ago" in err.text and "stopped during its build" in err.text
    assert capsys.readouterr().out == "kept line\n"  # DeepSpeed's per-rank "built successfully" dropped


def test_a_rank_that_does_not_report_waits_stays_quiet(tmp_path, monkeypatch):
    from torch.utils.file_baton import FileBaton

    lock = _stale_lock(tmp_path)
    monkeypatch.setenv("DPZERO_BUILD_LOCK_WARN_S", "0.2")
    err = _Stream("waiting")
    monkeypatch.setattr(sys, "stderr", err)
    threading.Timer(1.5, lock.unlink).start()
    with build_watched(report_waits=False):
        FileBaton(str(lock)).wait()
    assert err.text == ""


def _python(code: str, env: dict) -> str:
    env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_the_op_is_built_once_per_environment_unless_the_user_chose_a_directory(tmp_path):
    """A DP strategy sets TORCH_EXTENSIONS_DIR to <sys.prefix>/torch_extensions when it is not set (before the
    launcher starts the ranks, which inherit it), so every script of the environment reuses one build."""
    code = ("import os, sys\nfrom lightning_dpzero import DPFabricStrategy\nDPFabricStrategy(noise_multiplier=1.0)\n"
            "print(os.environ['TORCH_EXTENSIONS_DIR'] == os.path.join(sys.prefix, 'torch_extensions'), "
            "os.environ['TORCH_EXTENSIONS_DIR'])")
    unset = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    assert _python(code, unset).startswith("True ")
    assert _python(code, dict(unset, TORCH_EXTENSIONS_DIR=str(tmp_path))) == f"False {tmp_path}"


FABRIC_RUN = '''
import torch
from lightning.fabric import Fabric
from torch import nn
from lightning_dpzero import DPFabricStrategy

fabric = Fabric(accelerator="cpu", devices=1, strategy=DPFabricStrategy(stage=0, noise_multiplier=1.0))
fabric.launch()
print("started", flush=True)
'''


@pytest.mark.slow
def test_a_run_that_waits_on_a_stale_lock_says_so_instead_of_hanging(tmp_path):
    """The hang of the issue: a fresh environment's build directory holding a lock from a killed run. The run (a
    real Fabric start on the CPU) prints the message naming the lock; it is then stopped."""
    lock = _stale_lock(tmp_path / "ext")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), DPZERO_BUILD_LOCK_WARN_S="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    script = tmp_path / "run.py"
    script.write_text(FABRIC_RUN)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, start = [], time.perf_counter()
    timer = threading.Timer(300, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(f"    rm {lock}"):
                break
    finally:
        timer.cancel()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    print(f"said after {time.perf_counter() - start:.1f} s")  # measured, not asserted
    text = "\n".join(lines)
    assert f"rm {lock}" in text and "lightning_dpzero: waiting" in text and "started" not in text, text
