"""The checks a DP checkpoint directory must pass before anything in it is used, shared by loading
(:class:`~lightning_dpzero.checkpoints.CheckpointProtocol`), :func:`verify_checkpoint` and
``lightning-dpzero ledger verify`` (docs/design.md, *Checkpoints*; docs/reliability.md):

1. :func:`require_commit`: the commit marker exists; a directory this strategy wrote (its client state holds a
   privacy ledger) without one is refused, since the marker is the only thing that ties its shards together;
2. the files match the marker's sizes and SHA-256 (:func:`~lightning_dpzero.checkpoints.commit.file_problems`,
   split between ranks when loading);
3. the ``weights_only`` pre-scan (:mod:`~lightning_dpzero.checkpoints.safe_load`);
4. :func:`check_ledgers`: ``privacy_ledger.json``, the client state's copies and the marker name one ledger, and
   it charges at least the weights' step count (Lightning's ``global_step`` and DeepSpeed's ``global_steps`` in
   the client state, the marker's ``global_step``).

The client state is read with ``torch.load(weights_only=True)`` (and ``mmap``), so no code from the file runs.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import NamedTuple, Optional, Union

from ..accounting import PrivacyLedger
from .commit import (CheckpointIntegrityError, IncompleteCheckpointError, check_commit_matches, file_problems,
                     raise_file_problems, read_commit)
from .format import COMMIT_FILE, LEDGER_FILE
from .reader import CheckpointReadError, ledgers_in_state, model_states_file, read_client_state, same_ledger
from .safe_load import UnsafeCheckpointError, raise_escaping_paths, unsafe_pickle_reason


class ClientState(NamedTuple):
    """What the pre-load checks read from rank 0's DeepSpeed model-states file (``weights_only`` loading)."""

    ledgers: dict           #: ledger copies by where they were found
    global_step: Optional[int]    #: Lightning's ``global_step`` (None: not readable)
    deepspeed_steps: Optional[int]  #: DeepSpeed's ``global_steps`` (None: not readable)
    note: str               #: why nothing could be compared, or ""


class VerifiedCheckpoint(NamedTuple):
    """The outcome of :func:`check_ledgers`."""

    ledger: PrivacyLedger   #: the checkpoint's ledger (every copy found is this one)
    compared: list          #: where in the client state copies were found and compared
    note: str               #: what could not be compared (e.g. a client state that needs full unpickling)
    weights_steps: int      #: the largest step count the checkpoint claims for its weights


def read_state(directory: Path, trust: bool = False) -> ClientState:
    """The ledger copies and step counts of ``directory``'s client state; a file that ``weights_only`` refuses
    (and ``trust`` is False) or that is missing gives empty values and a note.

    Raises:
        CheckpointReadError: the model-states file is not a ``torch.save`` file or cannot be read.
        LedgerIntegrityError: a copy fails its hash chain.
    """
    f = model_states_file(directory)
    if f is None:
        return ClientState({}, None, None, "client state: not compared (no DeepSpeed model-states file found)")
    try:
        state = read_client_state(f, trust)
    except pickle.UnpicklingError as exc:
        why = next((ln.strip() for ln in str(exc).splitlines() if "Unsupported global" in ln), "")
        return ClientState({}, None, None, (
            f"client state: not compared ({f.name} needs full unpickling, which can run code from the file; pass "
            f"--trust-checkpoint for a checkpoint you trust; resuming refuses it unless "
            f"strategy.trust_checkpoint_pickles = True). {why}").strip())
    if not isinstance(state, dict):
        return ClientState({}, None, None, f"client state: {f.name} is not a dict")

    def steps(key):
        value = state.get(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    found = ledgers_in_state(state, f.name)
    return ClientState(found, steps("global_step"), steps("global_steps"),
                       "" if found else f"client state: {f.name} holds no privacy ledger")


def require_commit(directory: Path, required: bool, trust: bool = False) -> Optional[dict]:
    """The parsed marker. Without one: refused if the save was interrupted, if ``required`` and the directory holds
    ``privacy_ledger.json``, or if ``required`` and its client state holds a privacy ledger (it was written by
    this strategy, and only the marker says its shards belong together); else None (a directory this strategy did
    not write: the ledger check after loading names what is missing).

    Raises:
        IncompleteCheckpointError: as above.
        CheckpointIntegrityError: the marker is malformed.
    """
    commit = read_commit(directory, required)
    if commit is not None or not required:
        return commit
    try:
        ledgers = read_state(directory, trust).ledgers
    except (CheckpointReadError, ValueError):
        return None  # unreadable: DeepSpeed's own load fails on it, and the pickle scan refuses what it cannot read
    if ledgers:
        raise IncompleteCheckpointError(
            f"The checkpoint {directory} was written by DPDeepSpeedStrategy (its client state holds a privacy "
            f"ledger) but has no {COMMIT_FILE}: its save did not finish, or the marker was removed. Only the marker "
            "ties its shards together (they may be a mix of saves whose updates the ledger does not cover). Nothing "
            f"was loaded. Resume from a checkpoint whose directory holds {COMMIT_FILE}, or start a new run.")
    return None


def scan_problems(directory: Path, names: list) -> list:
    """``name: reason`` for each of ``names`` (``.pt`` files) that ``torch.load(weights_only=True)`` refuses."""
    return [f"{name}: {reason}" for name in names if (reason := unsafe_pickle_reason(directory / name))]


def raise_unsafe(directory: Path, problems: list) -> None:
    if problems:
        raise UnsafeCheckpointError(
            f"The checkpoint {directory} holds objects that loading could execute as code "
            f"({'; '.join(problems[:3])}). Nothing was unpickled. If you wrote this checkpoint yourself and "
            "trust it, set `strategy.trust_checkpoint_pickles = True` before fitting; otherwise do not load it.")


def check_ledgers(directory: Path, commit: dict, trust: bool = False) -> VerifiedCheckpoint:
    """Every ledger copy (``privacy_ledger.json``, the client state's) is one ledger, the one the marker names,
    and it charges at least as many steps as the weights hold (the client state's ``global_step`` and
    ``global_steps`` and the marker's ``global_step``).

    Raises:
        CheckpointIntegrityError: copies disagree, the marker names another ledger or step, or too few steps.
        LedgerIntegrityError: a copy fails its hash chain.
        ValueError: no ledger at all.
    """
    state = read_state(directory, trust)
    json_path = directory / LEDGER_FILE
    ledger = PrivacyLedger.load(json_path) if json_path.exists() else None
    first = str(json_path)
    for where, other in state.ledgers.items():
        if ledger is None:
            ledger, first = other, where
        elif not same_ledger(other, ledger):
            raise CheckpointIntegrityError(
                f"{first} and the ledger inside the checkpoint disagree (run {ledger.run_id}, {ledger.steps} steps; "
                f"{where}: run {other.run_id}, {other.steps} steps); the checkpoint may have been edited or mixed "
                "with another run. Refusing to resume.")
    if ledger is None:
        raise ValueError(f"The checkpoint {directory} holds no privacy ledger, so the privacy already spent is "
                         "unknown. Resume only from checkpoints written by DPDeepSpeedStrategy, or load the weights "
                         "into a fresh run (new ledger) without ckpt_path.")
    claimed = [s for s in (state.global_step, state.deepspeed_steps, commit.get("global_step")) if s is not None]
    global_step = state.global_step if state.global_step is not None else commit.get("global_step")
    check_commit_matches(directory, commit, ledger, global_step)
    weights_steps = max(claimed, default=0)
    check_steps_cover(directory, ledger, weights_steps)
    return VerifiedCheckpoint(ledger, list(state.ledgers), state.note, weights_steps)


def check_steps_cover(directory: Union[str, os.PathLike], ledger: PrivacyLedger, weights_steps: int) -> None:
    """Raise :class:`CheckpointIntegrityError` if the ledger charges fewer steps than the weights hold."""
    if ledger.steps < weights_steps:
        raise CheckpointIntegrityError(
            f"The checkpoint {directory} holds weights after {weights_steps} optimizer steps but its privacy "
            f"ledger charges only {ledger.steps}; the ε it would report is too small. Refusing to resume.")


def verify_checkpoint(path: Union[str, os.PathLike], trust: bool = False) -> dict:
    """Verify a checkpoint directory written by :class:`DPDeepSpeedStrategy` without loading it (one process): the
    same checks, in the same order, as loading it for training.

    Args:
        path: the checkpoint directory.
        trust: skip the ``weights_only`` pre-scan and read a client state that needs full unpickling (which can
            run code from the file: only for checkpoints you wrote yourself).

    Returns:
        its ``privacy_commit.json`` (``global_step``, ``ledger_steps``, ``ledger_head``, ``run_id``, ``files``,
        ``world_size``, ``zero_stage``).

    Raises:
        IncompleteCheckpointError: no marker (an interrupted save, or a marker removed).
        CheckpointIntegrityError: files, ledgers, the marker or the step counts disagree.
        UnsafeCheckpointError: a file holds objects that unpickling could execute (unless ``trust``); a link in the
            directory or a ``latest`` tag naming a folder outside it (always).
        LedgerIntegrityError: a ledger copy fails its hash chain.
    """
    return verify_directory(Path(path), trust)[0]


def verify_directory(directory: Path, trust: bool = False, unsafe_as_note: bool = False
                     ) -> tuple[dict, VerifiedCheckpoint]:
    """:func:`verify_checkpoint`, also returning what :func:`check_ledgers` found (the CLI prints it). With
    ``unsafe_as_note``, files the pre-scan refuses are named in the note instead of raising (the CLI without
    ``--trust-checkpoint``: the privacy record is still checked; resuming refuses such a checkpoint)."""
    from .commit import checkpoint_files

    raise_escaping_paths(directory)
    commit = require_commit(directory, required=True, trust=trust)
    if commit is None:
        raise IncompleteCheckpointError(f"{directory} has no {COMMIT_FILE}: not a complete DPDeepSpeedStrategy "
                                        "checkpoint.")
    raise_file_problems(directory, file_problems(directory, commit, sorted(commit["files"]), True))
    unsafe = [] if trust else scan_problems(directory, [n for n in checkpoint_files(directory) if n.endswith(".pt")])
    if not unsafe_as_note:
        raise_unsafe(directory, unsafe)
    verified = check_ledgers(directory, commit, trust)
    if unsafe:
        note = (f"unsafe pickles: {'; '.join(unsafe[:3])} (resuming refuses them unless "
                "strategy.trust_checkpoint_pickles = True)")
        verified = verified._replace(note="\n".join(n for n in (verified.note, note) if n))
    return commit, verified


def check_world_size(directory: Path, commit: dict, world_size: int, zero_stage: Optional[int]) -> None:
    """Refuse ZeRO (stage 1-3) shards written by another number of processes than this run's, before DeepSpeed
    loads anything: its optimizer partitions cannot be re-split (DeepSpeed would stop half-way with
    ``ZeRORuntimeException``). Stage-0 checkpoints (every rank holds everything) resume on any number; the
    ledger then continues with the new q, recorded as a new entry.

    Raises:
        ValueError: naming the saved and current numbers of processes and the fix; the checkpoint is untouched.
    """
    saved_world, saved_stage = commit.get("world_size"), commit.get("zero_stage")
    stages = [s for s in (saved_stage, zero_stage) if isinstance(s, int)]
    if not isinstance(saved_world, int) or saved_world == world_size or not stages or max(stages) < 1:
        return
    raise ValueError(
        f"The checkpoint {directory} holds ZeRO stage {saved_stage} shards written by {saved_world} processes; this "
        f"run has {world_size}. DeepSpeed cannot split ZeRO optimizer partitions for another number of processes, "
        f"so nothing was loaded and its privacy ledger ({commit.get('ledger_steps')} steps) is untouched. Resume "
        f"it on {saved_world} processes (Trainer(devices=..., num_nodes=...)). To train on another number of "
        "processes later, train with DPDeepSpeedStrategy(stage=0), whose checkpoints resume on any number (the "
        "ledger continues with the new sample rate). To keep the weights with their ledger outside DeepSpeed, "
        "export them with lightning_dpzero.checkpoints.convert_zero_checkpoint_with_ledger(ckpt_dir, "
        "'model.ckpt') (DeepSpeed's universal-checkpoint conversion is not supported: it drops the commit marker).")
