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
import pickle
import tempfile
from pathlib import Path
from typing import Literal, NamedTuple, Optional, Union

from ..accounting import LedgerIntegrityError, PrivacyLedger
from .format import LEDGER_FILE, LEDGER_KEY
from .reader import checkpoint_ledger, ledgers_in_state, read_client_state, same_ledger

PathLike = Union[str, os.PathLike]


class ExportedCheckpoint(NamedTuple):
    """What :func:`convert_zero_checkpoint_with_ledger` wrote.

    Example:
        >>> from pathlib import Path
        >>> out = ExportedCheckpoint(Path("model.ckpt"), Path("model.ckpt.privacy_ledger.json"),
        ...                          PrivacyLedger(delta=1e-5, dataset_size=100), embedded=True)
        >>> out.ledger_file.name, out.embedded
        ('model.ckpt.privacy_ledger.json', True)
    """

    output: Path               #: the consolidated weights (a file, or DeepSpeed's output directory)
    ledger_file: Path          #: the ledger JSON written beside (or inside) the output
    ledger: PrivacyLedger      #: the verified ledger
    embedded: bool             #: whether the ledger is also inside the output (key ``privacy_ledger``)


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
    if not same_ledger(written, source):
        raise LedgerIntegrityError(f"the ledger written to {where} does not match the checkpoint's.")


def convert_zero_checkpoint_with_ledger(ckpt_dir: PathLike, output_path: PathLike, tag: Optional[str] = None,
                                        output_format: Literal["auto", "lightning", "deepspeed"] = "auto",
                                        ) -> ExportedCheckpoint:
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
        for where, other in ledgers_in_state(client_state, str(output)).items():
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
    path = Path(path)
    json_path = path / LEDGER_FILE if path.is_dir() else path.with_name(path.name + "." + LEDGER_FILE)
    if not json_path.is_file():
        raise ValueError(f"{json_path} not found: {path} was not exported with its privacy ledger.")
    ledger = PrivacyLedger.load(json_path)
    if path.is_file():
        try:
            saved = read_client_state(path, trust=trust_file)
        except pickle.UnpicklingError as exc:
            raise ValueError(f"{path} needs full unpickling to compare its embedded ledger, which can run code "
                             "from the file; pass trust_file=True for a file you trust.") from exc
        if isinstance(saved, dict) and saved.get(LEDGER_KEY) is not None:
            embedded = PrivacyLedger.from_dict(saved[LEDGER_KEY])
            if not same_ledger(embedded, ledger):
                raise LedgerIntegrityError(f"{json_path} and the ledger inside {path} disagree.")
    return ledger
