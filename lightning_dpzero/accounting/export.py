"""Export a DeepSpeed ZeRO checkpoint to consolidated fp32 weights without losing its privacy ledger.

``convert_zero_checkpoint_with_ledger(ckpt_dir, output)`` runs the usual ``zero_to_fp32`` conversion and makes
the ledger travel with the weights:

* it reads the checkpoint's ledger from ``privacy_ledger.json`` beside the ZeRO shards and from the DeepSpeed
  client state (key ``privacy_ledger`` and the callback's state), verifies each hash chain and refuses copies
  that disagree, or a checkpoint that holds none;
* a single-file output (Lightning's conversion: a checkpoint dict with ``state_dict`` that
  ``LightningModule.load_from_checkpoint`` reads) gets the ledger embedded under the key ``privacy_ledger``, and
  ``<output>.privacy_ledger.json`` is written beside it;
* a directory output (DeepSpeed's conversion: ``pytorch_model.bin`` or ``model.safetensors``, possibly sharded;
  plain state dicts that ``load_state_dict`` must be able to read, so nothing is added to them) gets
  ``privacy_ledger.json`` inside;
* every written copy is read back and checked against the source (hash chain and head hash).

The ledger's ε is recomputed from its entries by anything that reads it (``lightning-dpzero ledger show
<output>.privacy_ledger.json``); no number is trusted.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import NamedTuple, Optional, Union

from .ledger import LedgerIntegrityError, PrivacyLedger

LEDGER_FILE = "privacy_ledger.json"    # the name DPDeepSpeedStrategy writes beside the ZeRO shards
LEDGER_KEY = "privacy_ledger"          # its key in the checkpoint's client state
CALLBACK_KEY = "PrivacyAccountantCallback"
_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")

PathLike = Union[str, os.PathLike]


class ExportedCheckpoint(NamedTuple):
    """What :func:`convert_zero_checkpoint_with_ledger` wrote."""

    output: Path               #: the consolidated weights (a file, or DeepSpeed's output directory)
    ledger_file: Path          #: the ledger JSON written beside (or inside) the output
    ledger: PrivacyLedger      #: the verified ledger
    embedded: bool             #: whether the ledger is also inside the output (key ``privacy_ledger``)


def _model_states_file(ckpt_dir: Path, tag: Optional[str]) -> Optional[Path]:
    tags = [tag] if tag else []
    latest = ckpt_dir / "latest"
    if not tags and latest.is_file():
        tags.append(latest.read_text().strip())
    tags.append("checkpoint")  # the tag Lightning's DeepSpeedStrategy saves under
    for t in tags:
        for name in _MODEL_STATES:
            if (ckpt_dir / t / name).is_file():
                return ckpt_dir / t / name
    return None


def client_state_ledgers(state: dict, where: str) -> dict[str, PrivacyLedger]:
    """Every ledger copy in a checkpoint's client state (the strategy's key and the callback's state), keyed by
    where it was found; raises ``LedgerIntegrityError`` naming ``where`` for an edited or corrupt copy."""
    found = {}
    try:
        if state.get(LEDGER_KEY) is not None:
            found[f"{where}:{LEDGER_KEY}"] = PrivacyLedger.from_dict(state[LEDGER_KEY])
        callbacks = state.get("callbacks")
        cb = callbacks.get(CALLBACK_KEY) if isinstance(callbacks, dict) else None
        if isinstance(cb, dict) and cb.get("ledger") is not None:
            found[f"{where}:callbacks.{CALLBACK_KEY}"] = PrivacyLedger.from_dict(cb["ledger"])
    except LedgerIntegrityError as exc:
        raise LedgerIntegrityError(f"the privacy ledger in the client state of {where} is corrupt or was edited: "
                                   f"{exc}") from exc
    return found


def checkpoint_ledger(ckpt_dir: PathLike, tag: Optional[str] = None) -> PrivacyLedger:
    """The verified privacy ledger of a DPDeepSpeedStrategy checkpoint directory.

    Reads ``privacy_ledger.json`` and the copies in the DeepSpeed client state (``torch.load`` with
    ``weights_only=True``; a client state that needs full unpickling is skipped when the JSON is present).

    Raises:
        LedgerIntegrityError: a copy fails its hash chain, or two copies disagree.
        ValueError: the checkpoint holds no ledger.
    """
    import pickle

    import torch

    ckpt_dir = Path(ckpt_dir)
    copies: dict[str, PrivacyLedger] = {}
    json_path = ckpt_dir / LEDGER_FILE
    if json_path.is_file():
        copies[str(json_path)] = PrivacyLedger.load(json_path)
    states = _model_states_file(ckpt_dir, tag)
    if states is not None:
        try:
            state = torch.load(states, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError):
            if not copies:
                raise
            state = {}
        if isinstance(state, dict):
            copies.update(client_state_ledgers(state, states.name))
    if not copies:
        raise ValueError(f"{ckpt_dir} holds no privacy ledger ({LEDGER_FILE} or client-state key {LEDGER_KEY!r}): "
                         "not a checkpoint written by DPDeepSpeedStrategy, so the privacy it spent is unknown; "
                         "refusing to export it as a DP model.")
    (first_where, ledger), *rest = copies.items()
    for where, other in rest:
        if other != ledger or other.head != ledger.head:
            raise LedgerIntegrityError(f"the privacy ledgers in {first_where} ({ledger.steps} steps) and {where} "
                                       f"({other.steps} steps) disagree; the checkpoint was edited or mixed with "
                                       "another run.")
    return ledger


def _atomic_torch_save(obj, path: Path) -> None:
    import torch

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _check_same(written: PrivacyLedger, source: PrivacyLedger, where) -> None:
    if written != source or written.head != source.head:
        raise LedgerIntegrityError(f"the ledger written to {where} does not match the checkpoint's.")


def convert_zero_checkpoint_with_ledger(ckpt_dir: PathLike, output_path: PathLike, tag: Optional[str] = None,
                                        output_format: str = "auto") -> ExportedCheckpoint:
    """Consolidate a ZeRO checkpoint into fp32 weights (``zero_to_fp32``) and carry its privacy ledger along.

    Args:
        ckpt_dir: the checkpoint directory written by ``trainer.save_checkpoint`` / ``ModelCheckpoint`` with a
            DP strategy (it holds the tag folder, ``latest`` and ``privacy_ledger.json``).
        output_path: where to write. A file (e.g. ``model.ckpt``): Lightning's
            ``convert_zero_checkpoint_to_fp32_state_dict``, a Lightning checkpoint dict with the fp32
            ``state_dict`` and, added here, ``privacy_ledger``; the JSON goes to ``<output>.privacy_ledger.json``.
            A directory (an existing one, or a path ending in a separator): DeepSpeed's
            ``deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict``, whose weight files are
            left as they are; the JSON goes to ``<output>/privacy_ledger.json``.
        tag: the checkpoint tag (default: from ``latest``).
        output_format: ``"auto"`` (as above), ``"lightning"`` (single file) or ``"deepspeed"`` (directory).

    Returns:
        :class:`ExportedCheckpoint` (output, ledger_file, the verified ledger, whether it was embedded).

    Raises:
        ValueError: the checkpoint holds no ledger, or bad ``output_format``.
        LedgerIntegrityError: a ledger copy fails its hash chain, copies disagree, or a written copy does not
            read back identical.

    Note: the conversion reads the checkpoint's client state with ``torch.load(weights_only=False)`` (as
    Lightning's and DeepSpeed's converters do): convert only checkpoints you trust.
    """
    import torch

    if output_format not in ("auto", "lightning", "deepspeed"):
        raise ValueError(f"output_format={output_format!r}; use 'auto', 'lightning' (one file) or 'deepspeed' "
                         "(a directory).")
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise ValueError(f"{ckpt_dir} is not a DeepSpeed checkpoint directory.")
    as_dir = str(output_path).endswith((os.sep, "/")) or Path(output_path).is_dir()
    if output_format == "auto":
        output_format = "deepspeed" if as_dir else "lightning"
    output = Path(output_path)
    ledger = checkpoint_ledger(ckpt_dir, tag)  # refuse before spending time on the conversion

    if output_format == "lightning":
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        output.parent.mkdir(parents=True, exist_ok=True)
        client_state = convert_zero_checkpoint_to_fp32_state_dict(ckpt_dir, output, tag=tag)
        # the client state may already carry copies (the strategy's key, the callback's state): they must agree
        for where, other in client_state_ledgers(client_state, str(output)).items():
            _check_same(other, ledger, where)
        client_state[LEDGER_KEY] = ledger.to_dict()
        _atomic_torch_save(client_state, output)
        ledger_file = output.with_name(output.name + "." + LEDGER_FILE)
        embedded = True
    else:
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        output.mkdir(parents=True, exist_ok=True)
        convert_zero_checkpoint_to_fp32_state_dict(str(ckpt_dir), str(output), tag=tag)
        ledger_file = output / LEDGER_FILE
        embedded = False
    ledger.save(ledger_file)

    # read back every copy and check it against the source, hash chain included
    _check_same(PrivacyLedger.load(ledger_file), ledger, ledger_file)
    if embedded:
        saved = torch.load(output, map_location="cpu", weights_only=False, mmap=True)
        _check_same(PrivacyLedger.from_dict(saved[LEDGER_KEY]), ledger, f"{output}:{LEDGER_KEY}")
    return ExportedCheckpoint(output=output, ledger_file=ledger_file, ledger=ledger, embedded=embedded)


def exported_ledger(path: PathLike, trust_file: bool = False) -> PrivacyLedger:
    """The verified ledger of an export: ``<file>.privacy_ledger.json`` (compared with the copy embedded in the
    file) or ``<dir>/privacy_ledger.json``.

    The file is read with ``torch.load(weights_only=True)``; a Lightning checkpoint holding other Python objects
    (hyper-parameters, ...) needs full unpickling, which can run code from the file: pass ``trust_file=True``
    for a file you trust.

    Raises:
        ValueError: no ledger found, or the file needs ``trust_file=True``.
        LedgerIntegrityError: edited, or the copies disagree.
    """
    import pickle

    import torch

    path = Path(path)
    json_path = path / LEDGER_FILE if path.is_dir() else path.with_name(path.name + "." + LEDGER_FILE)
    if not json_path.is_file():
        raise ValueError(f"{json_path} not found: {path} was not exported with its privacy ledger.")
    ledger = PrivacyLedger.load(json_path)
    if path.is_file():
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as exc:
            if not trust_file:
                raise ValueError(f"{path} needs full unpickling to compare its embedded ledger, which can run code "
                                 "from the file; pass trust_file=True for a file you trust.") from exc
            saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        if isinstance(saved, dict) and saved.get(LEDGER_KEY) is not None:
            embedded = PrivacyLedger.from_dict(saved[LEDGER_KEY])
            if embedded != ledger or embedded.head != ledger.head:
                raise LedgerIntegrityError(f"{json_path} and the ledger inside {path} disagree.")
    return ledger
