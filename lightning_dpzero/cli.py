"""The ``lightning-dpzero`` command.

* ``lightning-dpzero ledger show|verify|plot PATH``: read a privacy ledger, where PATH is a checkpoint
  directory written by :class:`~lightning_dpzero.DPDeepSpeedStrategy` (holding ``privacy_ledger.json``) or
  the JSON file itself. ε is always recomputed from the ledger's entries, never read from a stored number.
* anything else (``fit --config run.yaml``, ``validate``, ``--help``, ``--print_config``): Lightning's
  :class:`~lightning.pytorch.cli.LightningCLI`, with the DP strategies registered, so a YAML may say
  ``strategy: dp_deepspeed_stage_3`` or ``class_path: lightning_dpzero.DPDeepSpeedStrategy`` with
  ``init_args``. The model and the (optional) datamodule are named by ``class_path`` in the config.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from .accounting import LedgerEntry, LedgerIntegrityError, PrivacyLedger, compute_epsilon
from .checkpoints.commit import CheckpointIntegrityError, IncompleteCheckpointError
from .checkpoints.format import LEDGER_FILE
from .checkpoints.reader import CheckpointReadError
from .checkpoints.verify import verify_directory


class CLIError(Exception):
    """A user-facing failure of a ``ledger`` command: printed to stderr, exit status 1."""


# ---------------------------------------------------------------------------------------------- reading
def _resolve(path: str) -> tuple[Path, Optional[Path]]:
    """(ledger JSON file, checkpoint directory or None) for a PATH given on the command line."""
    p = Path(path)
    if p.is_dir():
        json_path = p / LEDGER_FILE
        if not json_path.is_file():
            raise CLIError(f"{p} holds no {LEDGER_FILE}: not a checkpoint written by DPDeepSpeedStrategy, "
                           "or the ledger was removed. The privacy spent by this checkpoint is unknown.")
        return json_path, p
    if p.is_file():
        return p, None
    raise CLIError(f"{p}: no such file or directory.")


def _load(json_path: Path) -> PrivacyLedger:
    try:
        return PrivacyLedger.load(json_path)
    except LedgerIntegrityError as exc:
        raise CLIError(f"TAMPERED or corrupt ledger {json_path}: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"cannot read {json_path}: {exc}") from exc


# ---------------------------------------------------------------------------------------------- commands
def _fmt_eps(eps: float) -> str:
    return "inf (an entry has noise_multiplier 0: no privacy)" if math.isinf(eps) else repr(eps)


def _summary(ledger: PrivacyLedger) -> dict:
    return {"run_id": ledger.run_id, "dataset_size": ledger.dataset_size, "delta": ledger.delta,
            "accountant": ledger.accountant,
            "entries": [{"sample_rate": e.sample_rate, "noise_multiplier": e.noise_multiplier,
                         "steps": e.steps, "sampler": e.sampler} for e in ledger.entries],
            "steps": ledger.steps, "epsilon": ledger.epsilon(), "epsilon_method": ledger.epsilon_bound().method,
            "epsilon_pld": ledger.epsilon(accountant="pld"), "epsilon_rdp": ledger.epsilon(accountant="rdp"),
            "value_discretization_interval": ledger.epsilon_bound(accountant="pld").value_discretization_interval,
            "versions": dict(ledger.versions), "head": ledger.head}


def _how(bound) -> str:
    """Which bound gave an epsilon, for `ledger show`."""
    if bound.method == "rdp" and bound.pld is not None:
        return f"RDP bound, tighter than the PLD bound {bound.pld!r} here"
    if bound.method == "pld":
        return f"PLD bound on a {bound.value_discretization_interval:g}-nat grid"
    return {"none": "exact: no step, or delta covers the chance an example is ever used",
            "sigma=0": "no noise"}.get(bound.method, bound.method)


def cmd_show(args) -> int:
    """Print the ledger's metadata, entries, total steps, ε (PLD, or RDP where tighter) and ε (RDP)."""
    json_path, _ = _resolve(args.path)
    ledger = _load(json_path)
    s = _summary(ledger)
    if args.json:
        print(json.dumps({k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in s.items()},
                         indent=2))
        return 0
    samplers = sorted({e.sampler for e in ledger.entries})
    sampler = ", ".join(samplers) or "-"
    if "shuffle" in samplers:
        sampler += " (shuffled fixed-size batches accounted as if Poisson: an approximation)"
    mark = {"pld": "", "rdp": ""}
    mark[ledger.accountant] = "  <- ledger's accountant"
    print(f"privacy ledger:   {json_path}")
    print(f"run id:           {ledger.run_id}")
    shards = "" if ledger.shard_sizes is None else f" (the sum of {len(ledger.shard_sizes)} ranks' shards: " \
        f"{', '.join(map(str, ledger.shard_sizes))})"
    print(f"dataset size N:   {ledger.dataset_size}{shards}")
    print(f"delta:            {ledger.delta!r}")
    print(f"accountant:       {ledger.accountant}")
    print(f"sampler:          {sampler}")
    print(f"entries:          {len(ledger.entries)}")
    print(f"  {'#':>3}  {'q (sample_rate)':>22}  {'sigma (noise_multiplier)':>24}  {'steps':>9}  sampler")
    for i, e in enumerate(ledger.entries, 1):
        print(f"  {i:>3}  {e.sample_rate!r:>22}  {e.noise_multiplier!r:>24}  {e.steps:>9}  {e.sampler}")
    print(f"total steps:      {ledger.steps}")
    print(f"epsilon (pld):    {_fmt_eps(s['epsilon_pld'])}  ({_how(ledger.epsilon_bound(accountant='pld'))}, "
          f"at delta={ledger.delta!r}){mark['pld']}")
    print(f"epsilon (rdp):    {_fmt_eps(s['epsilon_rdp'])}{mark['rdp']}")
    versions = ", ".join(f"{k} {v}" for k, v in sorted(ledger.versions.items())) or "-"
    print(f"versions:         {versions}")
    print(f"hash head:        {ledger.head}")
    return 0


def cmd_verify(args) -> int:
    """Check the hash chain and recompute ε; for a checkpoint directory, run the checks loading runs
    (:func:`~lightning_dpzero.checkpoints.verify.verify_directory`: commit marker, file digests, the ledger copies
    against each other and the marker, the ledger's steps against the weights' step count)."""
    json_path, ckpt_dir = _resolve(args.path)
    ledger = _load(json_path)  # verifies the hash chain and the head
    eps = ledger.epsilon()
    notes, covers = [], ""
    if ckpt_dir is not None:
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
          f"N={ledger.dataset_size}, epsilon={_fmt_eps(eps)} ({ledger.accountant}) at delta={ledger.delta!r}, "
          f"hash chain intact (head {ledger.head[:16]}){covers}")
    for note in notes:
        print(note)
    return 0


def epsilon_curve(ledger: PrivacyLedger, points: int = 100, accountant: Optional[str] = None
                  ) -> tuple[list[int], list[float]]:
    """ε (``compute_epsilon``) after t steps, at about ``points`` step counts t from 0 to the total,
    always including every entry boundary. Returns (steps, epsilons)."""
    accountant = accountant or ledger.accountant
    total = ledger.steps
    grid = {0, total}
    grid.update(round(total * i / max(1, points)) for i in range(points + 1))
    bounds, t = [], 0
    for e in ledger.entries:
        t += e.steps
        bounds.append(t)
    grid.update(bounds)
    xs, ys = sorted(grid), []
    for t in xs:
        prefix, left = [], t
        for e in ledger.entries:
            if left <= 0:
                break
            n = min(e.steps, left)
            prefix.append(LedgerEntry(e.sample_rate, e.noise_multiplier, n, e.sampler))
            left -= n
        ys.append(compute_epsilon(prefix, ledger.delta, accountant))
    return xs, ys


def cmd_plot(args) -> int:
    """Write a PNG of ε against steps (PLD and RDP), with entry boundaries marked."""
    json_path, _ = _resolve(args.path)
    ledger = _load(json_path)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise CLIError("`ledger plot` needs matplotlib: pip install matplotlib "
                       "(or lightning-dpzero[examples])") from exc
    accountants = ["pld", "rdp"] if args.accountant == "both" else [args.accountant]
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for acc in accountants:
        xs, ys = epsilon_curve(ledger, args.points, acc)
        ax.plot(xs, ys, "-" if acc == "pld" else "--", label=acc.upper())
    t = 0
    for e in ledger.entries[:-1]:
        t += e.steps
        ax.axvline(t, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel(f"epsilon at delta={ledger.delta:g}")
    ax.set_title(f"run {ledger.run_id[:12]}  N={ledger.dataset_size}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(args.output)
    fig.savefig(out, format="png", dpi=args.dpi)
    print(f"wrote {out} ({len(accountants)} curve(s), {ledger.steps} steps, "
          f"final epsilon={_fmt_eps(ledger.epsilon())} ({ledger.accountant}))")
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
    args = _ledger_parser().parse_args(list(argv))
    # dp-accounting's RDP warns (via absl) about Rényi orders it drops; the result is still an upper bound.
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        return args.func(args)
    except CLIError as exc:
        print(f"lightning-dpzero ledger {args.command}: {exc}", file=sys.stderr)
        return 1
    finally:
        absl.setLevel(level)


# ---------------------------------------------------------------------------------------------- LightningCLI
_DESCRIPTION = ("Lightning CLI with differentially private DeepSpeed strategies (strategy: dp_deepspeed_stage_3, or "
                "class_path: lightning_dpzero.DPDeepSpeedStrategy). Also: `lightning-dpzero ledger "
                "{show,verify,plot} PATH` to inspect a checkpoint's privacy ledger.")


def lightning_main(argv: Optional[Sequence[str]] = None):
    """Run :class:`~lightning.pytorch.cli.LightningCLI`; model and datamodule are named by ``class_path``."""
    from lightning.pytorch.cli import LightningCLI

    import lightning_dpzero  # noqa: F401  (registers the dp_deepspeed* strategies)

    # Like `python -m`, let a config's class_path name modules of the directory it is run from.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    return LightningCLI(subclass_mode_model=True, subclass_mode_data=True,
                        save_config_kwargs={"overwrite": True}, parser_kwargs={"description": _DESCRIPTION},
                        args=None if argv is None else list(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``lightning-dpzero``: ``ledger ...`` subcommands, else the Lightning CLI.

    Returns the exit status (the console script passes it to ``sys.exit``); argument errors and ``--help``
    raise ``SystemExit`` as usual. When stdout's reader goes away (``... | head``) it exits quietly with
    status 141 (128 + SIGPIPE), without a traceback.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if args and args[0] == "ledger":
            status = ledger_main(args[1:])
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
