"""DeepSpeed's CPU communication op, which DeepSpeed compiles with torch's C++ extension builder when a CPU run
starts its process group: where it is built, and what the user is told while it is (docs/design.md, *Layout*).

* **One build per environment.** torch builds into ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/
  torch_extensions/py3X_cpu``, shared by every environment of the user). :func:`default_build_dir` makes the
  default ``<sys.prefix>/torch_extensions`` when the user has not set one (as ``examples/digits.py`` and the tests
  did): set when a DP strategy is built, so the ranks the launcher starts inherit it and every script of the
  environment reuses the op compiled once.
* **A stale lock.** torch builds under a lock file (``FileBaton``: whoever creates ``<build dir>/lock`` compiles,
  the others wait until it is gone). A process killed while compiling leaves the lock behind, and every later run
  then waits for ever, silent at 0% CPU. :func:`build_watched` watches the thread that starts the process group:
  when it has waited on such a lock for ``DPZERO_BUILD_LOCK_WARN_S`` seconds (default 40), one message names the
  lock file, its age and the command that removes it; a build that is compiling says so once too.
* **Quiet when built.** DeepSpeed prints ``DeepSpeed ... built successfully`` once per rank at every start;
  that line is dropped (:class:`_WithoutLines`).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from typing import Iterator, Optional

#: seconds a build may wait on a lock file before the message (the environment variable overrides it)
WARN_AFTER_S = 40.0
#: seconds of compiling before the one line that says so
COMPILING_AFTER_S = 5.0
_BUILT = re.compile(r"DeepSpeed \S+ built successfully")


def default_build_dir() -> Optional[str]:
    """Set ``TORCH_EXTENSIONS_DIR`` to ``<sys.prefix>/torch_extensions`` unless it is set or that directory cannot
    be written (a system Python: torch's default is kept). Returns the directory in use (None: torch's default)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    path = os.path.join(sys.prefix, "torch_extensions")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    if not os.access(path, os.W_OK):
        return None
    os.environ["TORCH_EXTENSIONS_DIR"] = path
    return path


def _build_codes() -> tuple:
    """The code objects of torch's wait on a build lock and of its compile (imported by the watched thread, not
    the watcher)."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    return FileBaton.wait.__code__, getattr(getattr(cpp_extension, "_run_ninja_build", None), "__code__", None)


def _build_state(frame, codes: tuple) -> Optional[tuple[str, str]]:
    """``("wait", lock file)`` if ``frame``'s thread waits on a torch extension's build lock, ``("compile", build
    directory)`` if it compiles one, else None (``codes``: :func:`_build_codes`)."""
    wait, compiling = codes
    while frame is not None:
        if frame.f_code is wait:
            path = getattr(frame.f_locals.get("self"), "lock_file_path", None)
            return ("wait", path) if path else None
        if frame.f_code is compiling:
            return "compile", str(frame.f_locals.get("build_directory", ""))
        frame = frame.f_back
    return None


def _age(seconds: float) -> str:
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def lock_message(path: str, waited: float) -> str:
    """What a run waiting on the build lock ``path`` for ``waited`` seconds tells its user."""
    try:
        age = f"It was created {_age(time.time() - os.stat(path).st_mtime)} ago. "
    except OSError:
        age = ""
    return (f"lightning_dpzero: waiting {waited:.0f} s for the lock file\n    {path}\nwhich torch creates while it "
            f"compiles a C++ op (DeepSpeed's CPU communication op, compiled once per environment). {age}If no "
            "process is compiling it now, the lock was left by a run stopped during its build, and this run will "
            f"wait for ever: stop it (Ctrl+C), remove the lock with\n    rm {path}\nand start again.\n")


@contextlib.contextmanager
def build_watched(report_waits: bool = True) -> Iterator[None]:
    """Around the start of a CPU process group: report a wait on a build lock (``report_waits``; one rank per
    node says it) and a compile, once each, and drop DeepSpeed's ``built successfully`` line."""
    ident, done, codes = threading.get_ident(), threading.Event(), _build_codes()
    after = float(os.environ.get("DPZERO_BUILD_LOCK_WARN_S", WARN_AFTER_S))

    def watch() -> None:
        said: set[str] = set()
        since: dict[tuple[str, str], float] = {}
        while not done.wait(min(1.0, after / 4, COMPILING_AFTER_S / 4)):
            state = _build_state(sys._current_frames().get(ident), codes)
            if state is None or state[0] in said:
                continue
            started = since.setdefault(state, time.monotonic())
            waited = time.monotonic() - started
            if state[0] == "wait" and report_waits and waited >= after:
                sys.stderr.write(lock_message(state[1], waited))
            elif state[0] == "compile" and waited >= COMPILING_AFTER_S:
                sys.stderr.write(f"lightning_dpzero: compiling DeepSpeed's CPU communication op into {state[1]} "
                                 "(once per environment; a minute or two)\n")
            else:
                continue
            sys.stderr.flush()
            said.add(state[0])

    watcher = threading.Thread(target=watch, name="lightning_dpzero-build-watch", daemon=True)
    watcher.start()
    stdout = _WithoutLines(sys.stdout, _BUILT)
    try:
        with contextlib.redirect_stdout(stdout):
            yield
    finally:
        done.set()
        stdout.close_out()


class _WithoutLines:
    """A text stream that passes on every complete line but those matching ``pattern``."""

    def __init__(self, stream, pattern: re.Pattern) -> None:
        self._stream, self._pattern, self._pending = stream, pattern, ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            if not self._pattern.fullmatch(line):
                self._stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def close_out(self) -> None:
        """Pass on a last line without its newline."""
        if self._pending:
            self._stream.write(self._pending)
            self._pending = ""
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
