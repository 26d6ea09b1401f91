"""The ``lightning-dpzero`` command.

* ``lightning-dpzero ledger show|verify|plot PATH``: read a privacy ledger, where PATH is a checkpoint
  directory written by :class:`~lightning_dpzero.DPDeepSpeedStrategy` (holding ``privacy_ledger.json``) or
  the JSON file itself. ε is always recomputed from the ledger's entries, never read from a stored number.
* ``lightning-dpzero plan ...``: σ, q, steps and ε of a run before training it
  (:mod:`lightning_dpzero.planner`).
* ``lightning-dpzero wandb-summary RUN_DIR``: the DP series and the ledger of an offline W&B run
  (:mod:`lightning_dpzero.wandb_offline`).
* anything else (``fit --config run.yaml``, ``validate``, ``--help``, ``--print_config``): Lightning's
  :class:`~lightning.pytorch.cli.LightningCLI`, with the DP strategies registered, so a YAML may say
  ``strategy: dp_deepspeed_stage_3`` or ``class_path: lightning_dpzero.DPDeepSpeedStrategy`` with
  ``init_args``. The model and the (optional) datamodule are named by ``class_path`` in the config.

Only the Lightning CLI imports Lightning: ``ledger``, ``plan`` and ``wandb-summary`` import what they read
with (the ledger, dp-accounting; torch only to compare a checkpoint's client state), so they start in a
fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from .checkpoints.format import LEDGER_FILE

if TYPE_CHECKING:
    from .accounting import PrivacyLedger


class CLIError(Exception):
    """A user-facing failure of a ``ledger`` command: printed to stderr, exit status 1."""


# ---------------------------------------------------------------------------------------------- reading
def _resolve(path: str) -> tuple[Path, Optional[Path]]:
    """(ledger JSON file, checkpoint directory or None) for a PATH given on the command line: the JSON file, a
    checkpoint directory, or a directory with exactly one of those below it (a run's log directory)."""
    p = Path(path)
    if p.is_dir():
        json_path = p / LEDGER_FILE
        if not json_path.is_file():
            found = ledgers_below(p)
            if len(found) == 1:  # a run's log directory: its one checkpoint (or logger copy) with a ledger
                print(f"(the ledger below {p}: {found[0].parent})", file=sys.stderr)
                return found[0], found[0].parent
            if found:
                listed = "\n  ".join(str(f.parent) for f in found)
                raise CLIError(f"{p} holds no {LEDGER_FILE} itself; these directories below it do (newest first; "
                               f"pass one of them):\n  {listed}")
            raise CLIError(f"{p} holds no {LEDGER_FILE}, nor does any directory below it: not a checkpoint written "
                           "by DPDeepSpeedStrategy (was checkpointing off? Trainer(enable_checkpointing=False)), or "
                           "the ledger was removed. The privacy spent by this checkpoint is unknown.")
        return json_path, p
    if p.is_file():
        return p, None
    raise CLIError(f"{p}: no such file or directory.")


def ledgers_below(directory: Path, most: int = 8, depth: int = 4) -> list[Path]:
    """The ``privacy_ledger.json`` files at most ``depth`` levels below ``directory``, newest first (at most
    ``most``): where a run left its checkpoints and ledger copies."""
    found = []
    for level in range(1, depth + 1):
        found += [f for f in directory.glob("/".join(["*"] * level) + "/" + LEDGER_FILE) if f.is_file()]
    return sorted(found, key=lambda f: f.stat().st_mtime, reverse=True)[:most]


def _load(json_path: Path) -> "PrivacyLedger":
    from .accounting import LedgerIntegrityError, PrivacyLedger

    try:
        return PrivacyLedger.load(json_path)
    except LedgerIntegrityError as exc:
        raise CLIError(f"TAMPERED or corrupt ledger {json_path}: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"cannot read {json_path}: {exc}") from exc


# ---------------------------------------------------------------------------------------------- commands
def cmd_show(args) -> int:
    """Print the ledger's metadata, entries, total steps, ε (PLD, or RDP where tighter) and ε (RDP)."""
    from .accounting.report import ledger_lines, ledger_summary

    json_path, _ = _resolve(args.path)
    ledger = _load(json_path)
    print(json.dumps(ledger_summary(ledger), indent=2) if args.json else "\n".join(ledger_lines(ledger, json_path)))
    return 0


def cmd_verify(args) -> int:
    """Check the hash chain and recompute ε; for a checkpoint directory, run the checks loading runs
    (:func:`~lightning_dpzero.checkpoints.verify.verify_directory`: commit marker, file digests, the ledger copies
    against each other and the marker, the ledger's steps against the weights' step count)."""
    from .accounting.report import format_epsilon

    json_path, ckpt_dir = _resolve(args.path)
    ledger = _load(json_path)  # verifies the hash chain and the head
    eps = ledger.epsilon()
    notes, covers = [], ""
    if ckpt_dir is not None:  # a checkpoint directory: its checks read the weights' files (torch)
        from .accounting import LedgerIntegrityError
        from .checkpoints.commit import CheckpointIntegrityError, IncompleteCheckpointError
        from .checkpoints.reader import CheckpointReadError
        from .checkpoints.verify import verify_directory

        try:
            # the pre-scan imports DeepSpeed, whose log lines are not part of the report
            with contextlib.redirect_stdout(sys.stderr):
                commit, verified = verify_directory(ckpt_dir, trust=args.trust_checkpoint, unsafe_as_note=True)
        except IncompleteCheckpointError as exc:
            raise CLIError(f"INCOMPLETE: {exc}") from exc
        except CheckpointIntegrityError as exc:
            raise CLIError(f"MISMATCH: {exc}") from exc
        except LedgerIntegrityError as exc:
            raise CLIError(f"TAMPERED or corrupt ledger in {ckpt_dir}: {exc}") from exc
        except (CheckpointReadError, ValueError) as exc:
            raise CLIError(str(exc)) from exc
        if verified.compared:
            notes.append(f"client state: matches ({', '.join(verified.compared)})")
        notes += [n for n in verified.note.splitlines() if n]
        covers = (f", covering the weights' {verified.weights_steps} steps; commit marker and "
                  f"{len(commit['files'])} files verified")
    print(f"OK {json_path}: run {ledger.run_id}, {ledger.steps} steps in {len(ledger.entries)} entries, "
          f"N={ledger.dataset_size}, epsilon={format_epsilon(eps)} ({ledger.accountant}) at delta={ledger.delta!r}, "
          f"hash chain intact (head {ledger.head[:16]}){covers}")
    for note in notes:
        print(note)
    return 0


def epsilon_curve(ledger: "PrivacyLedger", points: int = 100, accountant: Optional[str] = None
                  ) -> tuple[list[int], list[float]]:
    """ε after t steps, at about ``points`` step counts: :func:`lightning_dpzero.accounting.report.epsilon_curve`."""
    from .accounting.report import epsilon_curve as curve

    return curve(ledger, points, accountant)


def cmd_plot(args) -> int:
    """Write a PNG of ε against steps (PLD and RDP), with entry boundaries marked."""
    from .accounting.report import format_epsilon, plot_epsilon

    json_path, _ = _resolve(args.path)
    ledger = _load(json_path)
    accountants = ["pld", "rdp"] if args.accountant == "both" else [args.accountant]
    try:
        out = plot_epsilon(ledger, args.output, accountants, args.points, args.dpi)
    except ImportError as exc:
        raise CLIError("`ledger plot` needs matplotlib: pip install matplotlib "
                       "(or lightning-dpzero[examples])") from exc
    print(f"wrote {out} ({len(accountants)} curve(s), {ledger.steps} steps, "
          f"final epsilon={format_epsilon(ledger.epsilon())} ({ledger.accountant}))")
    return 0


def _ledger_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-dpzero ledger",
                                description="Inspect a privacy ledger (epsilon is recomputed from its entries).")
    sub = p.add_subparsers(dest="command", required=True)
    path_help = f"checkpoint directory holding {LEDGER_FILE}, or the JSON file"
    show = sub.add_parser("show", help="print the ledger and its epsilon (PLD and RDP)")
    show.add_argument("path", help=path_help)
    show.add_argument("--json", action="store_true", help="print a JSON summary instead")
    show.set_defaults(func=cmd_show)
    verify = sub.add_parser("verify", help="check the hash chain and, for a checkpoint directory, what resuming "
                                           "checks (marker, files, ledger copies, steps); exit 1 if not OK")
    verify.add_argument("path", help=path_help)
    verify.add_argument("--trust-checkpoint", action="store_true",
                        help="skip the weights_only pre-scan and allow full unpickling (weights_only=False) of the "
                             "model-states file; it can run code from the file: trusted files only")
    verify.set_defaults(func=cmd_verify)
    plot = sub.add_parser("plot", help="plot epsilon against steps to a PNG (needs matplotlib)")
    plot.add_argument("path", help=path_help)
    plot.add_argument("-o", "--output", default="epsilon.png", help="PNG file to write (default: epsilon.png)")
    plot.add_argument("--accountant", choices=["pld", "rdp", "both"], default="both")
    plot.add_argument("--points", type=int, default=100, help="about how many step counts to evaluate")
    plot.add_argument("--dpi", type=int, default=120)
    plot.set_defaults(func=cmd_plot)
    return p


def ledger_main(argv: Sequence[str]) -> int:
    """``lightning-dpzero ledger ...``; returns the exit status (0 OK, 1 failure, 2 usage error)."""
    from .accounting.accountants import AccountingRangeError
    from .accounting.report import quiet_logs

    args = _ledger_parser().parse_args(list(argv))
    try:
        with quiet_logs():
            return args.func(args)
    except (CLIError, AccountingRangeError) as exc:
        print(f"lightning-dpzero ledger {args.command}: {exc}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------------------------------- LightningCLI
_DESCRIPTION = ("Lightning CLI with differentially private DeepSpeed strategies (strategy: dp_deepspeed_stage_3, or "
                "class_path: lightning_dpzero.DPDeepSpeedStrategy). Also: `lightning-dpzero ledger "
                "{show,verify,plot} PATH` to inspect a checkpoint's privacy ledger, `lightning-dpzero plan ...` for "
                "sigma, q, steps and epsilon before training, `lightning-dpzero wandb-summary RUN_DIR` for an offline "
                "W&B run's DP series and ledger.")


def lightning_main(argv: Optional[Sequence[str]] = None):
    """Run :class:`~lightning.pytorch.cli.LightningCLI`; model and datamodule are named by ``class_path``."""
    from .lightning.cli import build_cli

    return build_cli(argv, description=_DESCRIPTION)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``lightning-dpzero``: ``ledger ...``, ``plan ...``, ``wandb-summary ...``, else the
    Lightning CLI.

    Returns the exit status (the console script passes it to ``sys.exit``); argument errors and ``--help``
    raise ``SystemExit`` as usual. When stdout's reader goes away (``... | head``) it exits quietly with
    status 141 (128 + SIGPIPE), without a traceback.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if args and args[0] == "ledger":
            status = ledger_main(args[1:])
        elif args and args[0] == "plan":
            from .planner import plan_main

            status = plan_main(args[1:])
        elif args and args[0] == "wandb-summary":
            from .wandb_offline import summary_main

            status = summary_main(args[1:])
        else:
            lightning_main(argv)  # None: LightningCLI reads sys.argv itself (and warns if given both)
            status = 0
        sys.stdout.flush()  # a closed pipe shows up here for buffered output: catch it below, not at exit
        return status
    except BrokenPipeError:
        return _stdout_closed()


SIGPIPE_STATUS = 141  # 128 + SIGPIPE: what a shell reports for `cat`, `ls`, ... when the reader goes away


def _stdout_closed() -> int:
    """The reader of stdout went away (``lightning-dpzero ledger show ... | head``): stop quietly, as standard
    Unix tools do, instead of printing a BrokenPipeError traceback. stdout is pointed at /dev/null so that the
    interpreter's final flush of the unwritten buffer does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a file descriptor
        pass
    return SIGPIPE_STATUS


if __name__ == "__main__":
    sys.exit(main())
