"""The pre-scan that keeps loading a checkpoint from running code: ``torch.load(weights_only=True)`` first.

DeepSpeed itself unpickles its files with ``weights_only=False``; the strategy scans every ``.pt`` file of a
checkpoint with :func:`unsafe_pickle_reason` before it lets DeepSpeed load anything (docs/reliability.md).
"""

from __future__ import annotations

import importlib
import pickle
import re
from pathlib import Path
from typing import Optional

import torch


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds pickled objects that ``torch.load(weights_only=True)`` refuses to build."""


def safe_globals() -> list:
    """DeepSpeed's own classes in its optimizer-state files, allowed by the ``weights_only`` pre-scan."""
    out = []
    for module, names in (("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
                          ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
                          ("deepspeed.utils.tensor_fragment", ("fragment_address",))):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        out += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return out


def unsafe_pickle_reason(path: Path) -> Optional[str]:
    """None if ``torch.load(path, weights_only=True)`` succeeds (DeepSpeed's classes allowed), else why not.
    ``mmap`` keeps tensor data unread, so the scan costs little beyond the pickle itself."""
    with torch.serialization.safe_globals(safe_globals()):
        try:
            try:
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError:
                raise
            except (RuntimeError, ValueError):  # not the zip format, which mmap needs
                torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            text = str(exc)
            names = sorted(set(re.findall(r"GLOBAL ([\w.]+)", text))) or [text.splitlines()[0][:200] if text else
                                                                           type(exc).__name__]
            return "weights_only refused " + ", ".join(names)[:300]
        except Exception as exc:  # noqa: BLE001 - corrupt or foreign file: refuse, do not unpickle
            return f"unreadable ({type(exc).__name__}: {str(exc)[:200]})"
    return None
