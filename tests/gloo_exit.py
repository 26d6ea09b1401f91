"""One more try for a multi-process run that fails, the first failure kept visible as a warning.

Rarely (about 1 run in 40, seen only while other multi-process jobs load the machine) a 2-process gloo run dies
at exit ("terminate called without an active exception", SIGABRT) or loses its peer after its work is done. A
run that fails twice is reported with the second failure.
"""

import subprocess
import warnings
from typing import Callable


def run_with_one_retry(run: Callable[[], subprocess.CompletedProcess], what: str) -> subprocess.CompletedProcess:
    """``run()``, and once more if it exits non-zero; warns with the first failure where the second passes."""
    proc = run()
    if proc.returncode != 0:
        first = f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        proc = run()
        if proc.returncode == 0:
            warnings.warn(f"{what} failed once, then passed:\n{first}")
    return proc
