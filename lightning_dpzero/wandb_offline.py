"""Read an offline W&B run without uploading it: the DP series, the DP settings and the attached ledger.

``WandbLogger(offline=True)`` writes a directory ``wandb/offline-run-<time>-<id>/`` holding ``run-<id>.wandb``;
wandb has no Python reader for that file. It is a sequence of protobuf ``wandb_internal_pb2.Record`` messages in
the LevelDB log framing: a 7-byte file header (``:W&B``, magic, version), then 32 KiB blocks of pieces, each a
7-byte header ``crc32 | length (uint16) | type`` and its data; type 1 is a whole record, 2/3/4 the first, middle
and last pieces of a longer one, 0 (or a block tail shorter than a header) padding. :func:`read_records` parses
that framing and decodes each record with wandb's own protobuf classes; :func:`read_run` collects the history
rows, the config, the summary and the artifact records; :func:`offline_run_summary` picks the DP values and
the privacy ledger (``lightning-dpzero wandb-summary RUN_DIR`` prints it).

The ledger is the one :class:`~lightning_dpzero.metrics.PrivacyRunLogger` attached: the ``privacy-ledger``
artifact's staged copy (wandb keeps it until ``wandb sync``), else the copy it saves among the run's files
(``files/privacy_ledger.json``). Its hash chain is verified and ε recomputed from it, never taken from a number
the run stored.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

from .checkpoints.format import LEDGER_FILE

#: the type of the W&B artifact that holds a run's ledger (PrivacyRunLogger attaches it)
LEDGER_ARTIFACT_TYPE = "privacy-ledger"
_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _LAST = 1, 2, 4
#: the per-step values PrivacyAccountantCallback logs
DP_SERIES = ("epsilon", "delta", "noise_multiplier", "sample_rate", "dp_steps", "clip_fraction", "mean_grad_norm")
PathLike = Union[str, Path]


def read_records(path: PathLike) -> Iterator[Any]:
    """Yield the ``wandb.proto.wandb_internal_pb2.Record`` messages of an offline run file, in order.

    Raises:
        ValueError: the file is not a W&B transaction log.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if len(data) < _HEADER or data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log (run-<id>.wandb)")
    pos, pieces = _HEADER, []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        pieces = [chunk] if kind in (_FULL, _FIRST) else pieces + [chunk]
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(pieces))
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(run_file: PathLike) -> dict[str, Any]:
    """``{"history": [dict per logged row], "config": {...}, "summary": {...}, "artifacts": [ArtifactRecord],
    "run": {"id", "project", "entity"}}`` of an offline run file."""
    history, config, summary, artifacts, run = [], {}, {}, [], {}
    for r in read_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "config":
            config.update({_key(i): json.loads(i.value_json) for i in r.config.update})
        elif kind == "run":
            config.update({_key(i): json.loads(i.value_json) for i in r.run.config.update})
            run = {"id": r.run.run_id, "project": r.run.project, "entity": r.run.entity}
        elif kind == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in r.summary.update})
        elif kind == "artifact":
            artifacts.append(r.artifact)
    return {"history": history, "config": config, "summary": summary, "artifacts": artifacts, "run": run}


def series(history: list[dict], key: str) -> list:
    """The values of ``key`` over the history rows that have it, in order."""
    return [row[key] for row in history if key in row]


def run_file(path: PathLike) -> Path:
    """The ``run-<id>.wandb`` file for ``path``: the file itself, an ``offline-run-*`` directory, or a directory
    holding exactly one of those (``wandb/``, or the logger's ``save_dir``).

    Raises:
        FileNotFoundError: none found, or several (naming them).
    """
    p = Path(path)
    if p.is_file():
        return p
    found = sorted(p.glob("run-*.wandb")) or sorted(p.glob("offline-run-*/run-*.wandb")) or sorted(
        p.glob("wandb/offline-run-*/run-*.wandb"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise FileNotFoundError(f"{p}: no offline W&B run here (looked for run-*.wandb in it, in offline-run-*/ "
                                "and in wandb/offline-run-*/)")
    listed = "\n  ".join(str(f.parent) for f in found)
    raise FileNotFoundError(f"{p} holds {len(found)} offline runs; pass one of them:\n  {listed}")


def _ledger_file(run: dict, run_path: Path) -> Optional[Path]:
    for art in run["artifacts"]:
        if art.type == LEDGER_ARTIFACT_TYPE:
            for entry in art.manifest.contents:
                if entry.path.endswith(LEDGER_FILE) and entry.local_path and Path(entry.local_path).is_file():
                    return Path(entry.local_path)
    copy = run_path.parent / "files" / LEDGER_FILE
    return copy if copy.is_file() else None


def offline_run_summary(path: PathLike) -> dict[str, Any]:
    """The DP record of an offline W&B run: ``{"run_file", "run", "series": {name: [(step, value), ...]},
    "dp_config": {...}, "summary": {final_epsilon, final_dp_steps}, "ledger_file", "ledger"}``.

    ``series`` holds each of :data:`DP_SERIES` against the optimizer step (``trainer/global_step``, else
    ``dp_steps``); ``dp_config`` the run config's ``dp`` section (PrivacyRunLogger's DP settings); ``ledger``
    the verified :class:`~lightning_dpzero.PrivacyLedger` (None if the run has no ledger attached).

    Raises:
        FileNotFoundError: no (or more than one) offline run at ``path``.
        LedgerIntegrityError: the attached ledger does not match its hash chain.
    """
    from .accounting import PrivacyLedger

    path_run = run_file(path)
    run = read_run(path_run)
    out_series: dict[str, list] = {}
    for row in run["history"]:
        step = row.get("trainer/global_step", row.get("dp_steps", row.get("_step")))
        for key in DP_SERIES:
            if key in row:
                out_series.setdefault(key, []).append((step, row[key]))
    ledger_path = _ledger_file(run, path_run)
    dp_config = run["config"].get("dp", {})
    if isinstance(dp_config, dict) and "value" in dp_config and len(dp_config) == 1:  # wandb's {"value": ...} form
        dp_config = dp_config["value"]
    return {"run_file": str(path_run), "run": run["run"], "series": out_series, "dp_config": dp_config,
            "summary": {k: run["summary"][k] for k in ("final_epsilon", "final_dp_steps") if k in run["summary"]},
            "ledger_file": None if ledger_path is None else str(ledger_path),
            "ledger": None if ledger_path is None else PrivacyLedger.load(ledger_path)}


# ---------------------------------------------------------------------------------------------- the command
def _table(series_: dict[str, list]) -> list[str]:
    keys = [k for k in DP_SERIES if k in series_]
    if not keys:
        return ["(no DP values in the history: was PrivacyAccountantCallback among the callbacks?)"]
    rows: dict[Any, dict] = {}
    for k in keys:
        for step, value in series_[k]:
            rows.setdefault(step, {})[k] = value
    lines = ["  " + "  ".join([f"{'step':>6}"] + [f"{k:>16}" for k in keys])]
    for step in sorted(rows, key=lambda s: (s is None, s)):
        cells = [f"{'' if step is None else step:>6}"] + [f"{rows[step].get(k, ''):>16.10g}"
                                                          if isinstance(rows[step].get(k), (int, float))
                                                          else f"{'':>16}" for k in keys]
        lines.append("  " + "  ".join(cells))
    return lines


def summary_main(argv: Sequence[str]) -> int:
    """``lightning-dpzero wandb-summary RUN_DIR``: 0 on success, 1 with a message on stderr."""
    p = argparse.ArgumentParser(
        prog="lightning-dpzero wandb-summary",
        description="Print the per-step DP values (epsilon, delta, sigma, q, steps, clipping), the DP settings and "
                    "the attached privacy ledger of an offline W&B run, without uploading it.")
    p.add_argument("path", metavar="RUN_DIR", help="wandb/offline-run-<time>-<id> (or its run-<id>.wandb, or a "
                                                   "directory holding one offline run)")
    p.add_argument("--json", action="store_true", help="print it as JSON (the ledger as its summary)")
    args = p.parse_args(list(argv))
    from .accounting import LedgerIntegrityError
    from .accounting.report import ledger_lines, ledger_summary, quiet_logs

    try:
        with quiet_logs():
            s = offline_run_summary(args.path)
            ledger = s.pop("ledger")
            if args.json:
                s["ledger"] = None if ledger is None else ledger_summary(ledger)
                print(json.dumps(s, indent=2))
                return 0
            run = s["run"]
            print(f"W&B offline run:  {s['run_file']}")
            print(f"run id:           {run.get('id', '-')}  (project {run.get('project') or '-'})")
            settings = ", ".join(f"{k}={v}" for k, v in sorted(s["dp_config"].items())) or "-"
            print(f"DP settings:      {settings}")
            print("per-step values (PrivacyAccountantCallback; epsilon is the tracker's upper bound):")
            print("\n".join(_table(s["series"])))
            for k, v in s["summary"].items():
                print(f"{k + ':':<18}{v}")
            if ledger is None:
                print("ledger:           none attached (add lightning_dpzero.metrics.PrivacyRunLogger to the callbacks)")
            else:
                print("\n".join(ledger_lines(ledger, s["ledger_file"])))
    except (FileNotFoundError, ValueError) as exc:  # LedgerIntegrityError is a ValueError
        kind = "TAMPERED or corrupt ledger: " if isinstance(exc, LedgerIntegrityError) else ""
        print(f"lightning-dpzero wandb-summary: {kind}{exc}", file=sys.stderr)
        return 1
    return 0
