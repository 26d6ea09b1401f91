"""Reading the ledger copies of a checkpoint directory or an export, shared by the CLI and the export.

A checkpoint holds its ledger as ``privacy_ledger.json`` and in the DeepSpeed client state of rank 0's
model-states file (under the strategy's key and in the accountant callback's state). The client state is read
with ``torch.load(weights_only=True)``, so no code from the file runs, and ``mmap`` leaves the weights unread;
only a caller's explicit ``trust=True`` (the CLI's ``--trust-checkpoint``, the export's ``trust_file=True``)
lets it fall back to full unpickling for a file the user's module filled with other Python objects.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, Optional, Union

from ..accounting import LedgerIntegrityError, PrivacyLedger
from .format import CALLBACK_STATE_KEY, DEFAULT_TAG, LEDGER_FILE, LEDGER_KEY, MODEL_STATES_FILES
from .safe_load import raise_escaping_paths

PathLike = Union[str, os.PathLike]


class CheckpointReadError(ValueError):
    """A checkpoint's model-states file exists but cannot be read (not a ``torch.save`` file, truncated)."""


def model_states_file(ckpt_dir: Path, tag: Optional[str] = None) -> Optional[Path]:
    """Rank 0's DeepSpeed model-states file (ZeRO 0-2 or ZeRO-3 name) under ``tag``, else under the tag named by
    ``latest``, else under Lightning's tag ``checkpoint``; None if there is none."""
    tags = [tag] if tag else []
    latest = Path(ckpt_dir) / "latest"
    if not tags and latest.is_file():
        tags.append(latest.read_text().strip())
    tags.append(DEFAULT_TAG)
    for t in tags:
        for name in MODEL_STATES_FILES:
            if (Path(ckpt_dir) / t / name).is_file():
                return Path(ckpt_dir) / t / name
    return None


def read_client_state(path: Path, trust: bool = False) -> Any:
    """``torch.load`` a checkpoint file on the CPU with ``weights_only=True`` (``mmap`` when the file allows).

    With ``trust=True`` a file that ``weights_only=True`` refuses is loaded fully (``weights_only=False``), which
    can run code from the file: only for files the user said they trust.

    Raises:
        pickle.UnpicklingError: ``weights_only=True`` refused the file and ``trust`` is False.
        CheckpointReadError: the file is unreadable.
    """
    import torch

    def load(weights_only: bool) -> Any:
        try:
            return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        except RuntimeError as exc:  # mmap needs the zipfile format; an older file is read whole
            if "mmap" not in str(exc):
                raise
            return torch.load(path, map_location="cpu", weights_only=weights_only)

    try:
        return load(weights_only=True)
    except pickle.UnpicklingError:
        if not trust:
            raise
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointReadError(f"cannot read the checkpoint's client state {path}: {exc}") from exc
    try:
        return load(weights_only=False)  # explicitly trusted by the user
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise CheckpointReadError(f"cannot read the checkpoint's client state {path}: {exc}") from exc


def ledgers_in_state(state: dict, where: str) -> dict[str, PrivacyLedger]:
    """Every ledger copy in a checkpoint's client state (the strategy's key and the callback's state), keyed by
    where it was found; raises ``LedgerIntegrityError`` naming ``where`` for an edited or corrupt copy."""
    found = {}
    try:
        if state.get(LEDGER_KEY) is not None:
            found[f"{where}:{LEDGER_KEY}"] = PrivacyLedger.from_dict(state[LEDGER_KEY])
        callbacks = state.get("callbacks")
        cb = callbacks.get(CALLBACK_STATE_KEY) if isinstance(callbacks, dict) else None
        if isinstance(cb, dict) and cb.get("ledger") is not None:
            found[f"{where}:callbacks.{CALLBACK_STATE_KEY}"] = PrivacyLedger.from_dict(cb["ledger"])
    except LedgerIntegrityError as exc:
        raise LedgerIntegrityError(f"the privacy ledger in the client state of {where} is corrupt or was edited: "
                                   f"{exc}") from exc
    return found


def client_state_ledgers(ckpt_dir: PathLike, tag: Optional[str] = None, trust: bool = False
                         ) -> tuple[dict[str, PrivacyLedger], str]:
    """The ledger copies in a checkpoint directory's client state, keyed by where they were found, and, when
    there are none, a note saying why none could be compared.

    Raises:
        pickle.UnpicklingError: the client state needs full unpickling and ``trust`` is False.
        CheckpointReadError: the model-states file is not a ``torch.save`` (zip) file, or cannot be read.
        LedgerIntegrityError: a copy fails its hash chain.
    """
    f = model_states_file(Path(ckpt_dir), tag)
    if f is None:
        return {}, "client state: not compared (no DeepSpeed model-states file found)"
    if not zipfile.is_zipfile(f):
        raise CheckpointReadError(f"cannot read the checkpoint's client state {f}: not a torch.save (zip) file.")
    state = read_client_state(f, trust)
    if not isinstance(state, dict):
        return {}, f"client state: {f.name} is not a dict"
    found = ledgers_in_state(state, f.name)
    return found, "" if found else f"client state: {f.name} holds no privacy ledger"


def same_ledger(a: PrivacyLedger, b: PrivacyLedger) -> bool:
    """The same run, the same entries and the same head hash."""
    return a == b and a.head == b.head


def checkpoint_ledger(ckpt_dir: PathLike, tag: Optional[str] = None) -> PrivacyLedger:
    """The verified privacy ledger of a DPDeepSpeedStrategy checkpoint directory.

    Reads ``privacy_ledger.json`` and the copies in the DeepSpeed client state (``torch.load`` with
    ``weights_only=True``; a client state that needs full unpickling, or cannot be read, is skipped when the
    JSON is present).

    Raises:
        LedgerIntegrityError: a copy fails its hash chain, or two copies disagree.
        ValueError: the checkpoint holds no ledger (:class:`CheckpointReadError` when its client state, the only
            place one could be, cannot be read).
        pickle.UnpicklingError: no JSON copy, and the client state needs full unpickling.
    """
    ckpt_dir = Path(ckpt_dir)
    raise_escaping_paths(ckpt_dir, tag)  # (the export then lets DeepSpeed's converter unpickle the tag folder)
    copies: dict[str, PrivacyLedger] = {}
    json_path = ckpt_dir / LEDGER_FILE
    if json_path.is_file():
        copies[str(json_path)] = PrivacyLedger.load(json_path)
    try:
        found, _ = client_state_ledgers(ckpt_dir, tag)
    except (pickle.UnpicklingError, CheckpointReadError):
        if not copies:
            raise
        found = {}
    copies.update(found)
    if not copies:
        raise ValueError(f"{ckpt_dir} holds no privacy ledger ({LEDGER_FILE} or client-state key {LEDGER_KEY!r}): "
                         "not a checkpoint written by DPDeepSpeedStrategy, so the privacy it spent is unknown; "
                         "refusing to export it as a DP model.")
    (first_where, ledger), *rest = copies.items()
    for where, other in rest:
        if not same_ledger(other, ledger):
            raise LedgerIntegrityError(f"the privacy ledgers in {first_where} ({ledger.steps} steps) and {where} "
                                       f"({other.steps} steps) disagree; the checkpoint was edited or mixed with "
                                       "another run.")
    return ledger
