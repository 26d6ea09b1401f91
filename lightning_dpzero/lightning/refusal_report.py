"""How a refusal reaches the person who started the run: once, message first (docs/design.md, *Where each piece
runs*: launch).

Every rank of a DP run reaches the same verdict on what it refuses (the checks are deterministic, or agreed in a
collective), and each process that dies of an exception prints its traceback with the message at the bottom: the
same message once per rank, under 50-90 lines of start-up output. The hook installed here prints an exception
raised by this package (the innermost frame of its traceback is in ``lightning_dpzero``; a ``ValueError``,
``TypeError`` or ``RuntimeError``, which is how every refusal is raised) message first, then where it was raised, on
rank 0; another rank prints one line naming the exception. Any other exception goes to the hook that was there.
"""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType
from typing import Optional

#: the package's root folder (this file is in its lightning/ folder): a frame in any of its modules counts
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_rank = 0


def set_rank(rank: int) -> None:
    """This process's global rank (set when the strategy knows it; 0 in the launching process before)."""
    global _rank
    _rank = int(rank)


def is_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by this package (its innermost frame) as one of the exceptions it refuses with."""
    if not isinstance(exc, (ValueError, TypeError, RuntimeError)):
        return False
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and os.path.abspath(last.tb_frame.f_code.co_filename).startswith(_PACKAGE)


def format_refusal(exc: BaseException) -> str:
    """The message (with any notes) first, then the frames that raised it."""
    message = "".join(traceback.format_exception_only(type(exc), exc))
    frames = "".join(traceback.format_tb(exc.__traceback__))
    return f"{message}\nRaised at (most recent call last):\n{frames}"


def _hook(exc_type: type, exc: BaseException, tb: Optional[TracebackType]) -> None:
    if not is_refusal(exc):
        return _hook.previous(exc_type, exc, tb)
    if _rank != 0 and not getattr(exc, "print_on_this_rank", False):
        # (once the process group is up, torch's own excepthook puts "[rankN]: " in front of what this one prints)
        dist = sys.modules.get("torch.distributed")
        prefixed = dist is not None and dist.is_available() and dist.is_initialized()
        sys.stderr.write(f"{'' if prefixed else f'[rank {_rank}] '}stopped: {exc_type.__name__} (rank 0 prints the "
                         "message)\n")
    else:
        sys.stderr.write(format_refusal(exc))
    sys.stderr.flush()


def install() -> None:
    """Put :func:`_hook` in front of ``sys.excepthook`` (once per process)."""
    if not hasattr(_hook, "previous"):  # once: a hook put in front of ours later keeps calling ours
        _hook.previous = sys.excepthook
        sys.excepthook = _hook
