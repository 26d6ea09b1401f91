"""The pre-scan that keeps loading a checkpoint from running code: ``torch.load(weights_only=True)`` first.

DeepSpeed itself unpickles its files with ``weights_only=False``; the strategy scans every ``.pt`` file of a
checkpoint with :func:`unsafe_pickle_reason` before it lets DeepSpeed load anything (docs/reliability.md). The scan
covers the files inside the directory, so :func:`raise_escaping_paths` first makes sure those are all the files
DeepSpeed will open: no link, and a ``latest`` tag that names a folder inside the directory.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
from pathlib import Path
from typing import Optional, Union

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


#: the file in which DeepSpeed names the tag folder it loads (``load_checkpoint(tag=None)``)
LATEST_FILE = "latest"


def escaping_paths(directory: Union[str, os.PathLike], tag: Optional[str] = None) -> list:
    """``name: reason`` for every path of the checkpoint ``directory`` through which loading it would open a file
    that is not a regular file inside it (so neither the commit marker's digests nor the pickle scan covered it):
    a symbolic link anywhere in it (file or folder, ``latest`` included), anything that is not a regular file or a
    folder, and a tag (``tag``, else the content of ``latest``, as DeepSpeed reads it) whose folder resolves
    (``os.path.realpath``) outside the directory or to something other than a folder. Only names are read.
    """
    directory = Path(directory)
    root = os.path.realpath(directory)
    problems = []
    for dirpath, dirnames, filenames in os.walk(directory):  # (does not descend into linked folders)
        for name in sorted(dirnames + filenames):
            path = Path(dirpath, name)
            rel = path.relative_to(directory).as_posix()
            if path.is_symlink():
                problems.append(f"{rel}: a symbolic link (to {os.readlink(path)})")
            elif not (path.is_dir() or path.is_file()):
                problems.append(f"{rel}: not a regular file")
    latest = directory / LATEST_FILE
    if tag is None and latest.is_file() and not latest.is_symlink():
        with open(latest, encoding="utf-8", errors="replace") as f:
            tag = f.read().strip()  # as DeepSpeed reads it
    if tag:
        target = os.path.realpath(os.path.join(directory, tag))
        if os.path.commonpath([root, target]) != root or target == root:
            where = "the checkpoint directory itself" if target == root else "outside the checkpoint directory"
            problems.append(f"{LATEST_FILE}: the tag {tag!r} names {target}, {where}")
        elif os.path.lexists(target) and not os.path.isdir(target):
            problems.append(f"{LATEST_FILE}: the tag {tag!r} names {target}, which is not a folder")
    return problems


def raise_escaping_paths(directory: Union[str, os.PathLike], tag: Optional[str] = None) -> None:
    """Raise :class:`UnsafeCheckpointError` naming each path :func:`escaping_paths` finds, before anything in the
    checkpoint is read or unpickled (whatever ``trust_checkpoint_pickles`` says: these files were never checked)."""
    problems = escaping_paths(directory, tag)
    if problems:
        raise UnsafeCheckpointError(
            f"The checkpoint {directory} would make DeepSpeed open files that are not regular files inside it "
            f"({'; '.join(problems[:3])}{' …' if len(problems) > 3 else ''}); neither its commit marker nor the "
            "pickle scan covers those, and unpickling them could run code. Nothing was unpickled. Copy the files "
            "into the directory (no links) and write the tag folder's name, e.g. 'checkpoint', in 'latest'.")
