"""The commit marker of a DP checkpoint: written last, read and verified before anything is unpickled.

A DeepSpeed checkpoint directory is usable only once rank 0 has written ``privacy_commit.json`` (ledger run id,
head hash and steps, ``global_step``, size and SHA-256 of every file) after every shard and the ledger;
``.privacy_checkpoint_incomplete`` marks a save in progress (docs/design.md, *Checkpoints*; docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

from ..util.atomic import atomic_write_text, fsync_dir
from ..accounting import PrivacyLedger
from .format import COMMIT_FILE, COMMIT_FORMAT, COMMIT_FORMAT_VERSION, INCOMPLETE_FILE, LEDGER_FILE


class IncompleteCheckpointError(ValueError):
    """A checkpoint directory without its commit marker: the save was interrupted (or never finished)."""


class CheckpointIntegrityError(ValueError):
    """A checkpoint whose files, ledgers or commit marker disagree (edited, truncated, mixed from two saves)."""


def write_commit(directory: Path, commit: dict) -> None:
    """Rank 0, after every other file is on disk: the marker that makes the directory a usable checkpoint."""
    atomic_write_text(directory / COMMIT_FILE, json.dumps(commit, indent=2, sort_keys=True, allow_nan=False))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / INCOMPLETE_FILE)
    fsync_dir(directory)


def checkpoint_files(directory: Path) -> list[str]:
    """Sorted POSIX paths, relative to ``directory``, of the files a commit covers (not the markers, not the
    temp files of atomic writes)."""
    out = []
    for root, _, names in os.walk(directory):
        for name in names:
            if name in (COMMIT_FILE, INCOMPLETE_FILE) or (name.startswith(".") and name.endswith(".tmp")):
                continue
            out.append(Path(root, name).relative_to(directory).as_posix())
    return sorted(out)


def file_digest(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex digest}`` of one file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def read_commit(directory: Path, required: bool) -> Optional[dict]:
    """The parsed marker; None if absent and the directory does not look half-written; raises otherwise."""
    marker = directory / COMMIT_FILE
    if not marker.exists():
        incomplete = (directory / INCOMPLETE_FILE).exists()
        if incomplete or ((directory / LEDGER_FILE).exists() and required):
            raise IncompleteCheckpointError(
                f"The checkpoint {directory} has no {COMMIT_FILE}: "
                + ("its save was interrupted (the process stopped while writing it), so its shards may be missing, "
                   "truncated or a mix of two saves. " if incomplete else
                   "its save did not finish (or it was written before commit markers existed). ")
                + f"Nothing was loaded. Resume from an earlier checkpoint whose directory holds {COMMIT_FILE}, or "
                "start a new run.")
        return None
    try:
        commit = json.loads(marker.read_text(encoding="utf-8"))
        if commit.get("format") != COMMIT_FORMAT or commit.get("format_version") != COMMIT_FORMAT_VERSION:
            raise ValueError(f"not a version-{COMMIT_FORMAT_VERSION} {COMMIT_FORMAT} document")
        if not isinstance(commit["files"], dict):
            raise TypeError("'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointIntegrityError(f"{marker} is unreadable or malformed ({exc}); refusing to load "
                                       f"{directory}.") from exc
    return commit


def file_problems(directory: Path, commit: dict, names: list[str], check_unlisted: bool) -> list[str]:
    """What differs between the files ``names`` and their digests in ``commit`` (and, with ``check_unlisted``,
    which ``.pt`` files the commit does not list), one line per file."""
    files, problems = commit["files"], []
    for name in names:
        expected = files[name]
        try:
            actual = file_digest(directory / name)
        except OSError:
            problems.append(f"{name}: missing")
            continue
        if actual != expected:
            problems.append(f"{name}: size/SHA-256 {actual['size']}/{actual['sha256'][:12]}… differ from the "
                            f"commit's {expected.get('size')}/{str(expected.get('sha256'))[:12]}…")
    if check_unlisted:
        problems += [f"{n}: not covered by the commit" for n in checkpoint_files(directory)
                     if n not in files and n.endswith(".pt")]
    return problems


def raise_file_problems(directory: Path, problems: list[str]) -> None:
    """Raise :class:`CheckpointIntegrityError` listing the first five problems, if there are any."""
    if problems:
        raise CheckpointIntegrityError(
            f"The checkpoint {directory} does not match its {COMMIT_FILE} ({'; '.join(problems[:5])}"
            f"{' …' if len(problems) > 5 else ''}): files were changed, truncated or replaced after it was "
            "written. Nothing was loaded; resume from another checkpoint.")


def check_commit_matches(directory: Path, commit: dict, ledger: PrivacyLedger, global_step: int) -> None:
    """Raise :class:`CheckpointIntegrityError` unless the marker names this ledger (run id, head, steps) and step."""
    found = {"run_id": ledger.run_id, "ledger_head": ledger.head, "ledger_steps": ledger.steps,
             "global_step": global_step}
    diffs = [f"{k}: {COMMIT_FILE} says {commit.get(k)!r}, the checkpoint {v!r}" for k, v in found.items()
             if commit.get(k) != v]
    if diffs:
        raise CheckpointIntegrityError(
            f"The checkpoint {directory} disagrees with its {COMMIT_FILE} ({'; '.join(diffs)}): its ledger or "
            "client state belongs to another save or run. Refusing to resume.")
