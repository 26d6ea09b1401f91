"""A privacy ledger as people read it: the text of ``lightning-dpzero ledger show``, its JSON summary, and ε
against steps (the curve and its PNG). Shared by the ``ledger``, ``plan`` and ``wandb-summary`` commands; it
imports dp-accounting (through the ledger) but neither Lightning nor torch.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

if TYPE_CHECKING:
    from . import PrivacyLedger


#: dp-accounting's RDP warns (through absl) about Rényi orders it drops; its result is still an upper bound
ACCOUNTING_NOISE = ("absl",)


@contextlib.contextmanager
def quiet_logs(names: Sequence[str] = ACCOUNTING_NOISE, level: int = logging.ERROR) -> Iterator[None]:
    """Raise the level of the loggers ``names`` to ``level`` for the block (a command's own output stays
    readable), and restore them after."""
    loggers = [logging.getLogger(n) for n in names]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(level, lg.level))
    try:
        yield
    finally:
        for lg, old in zip(loggers, saved):
            lg.setLevel(old)


def format_epsilon(eps: float, truncated: bool = False) -> str:
    """``repr(eps)``, or what an infinite ε means (``truncated``: bounded micro-batches, whose truncation can take
    all of δ at a large ε)."""
    if not math.isinf(eps):
        return repr(eps)
    if truncated:
        return "inf (no noise, or the micro-batch truncation's (1 + e^eps)*p(T) exceeds delta at this epsilon)"
    return "inf (an entry has noise_multiplier 0: no privacy)"


def ledger_summary(ledger: "PrivacyLedger") -> dict:
    """The ledger's metadata, entries, steps and ε (its accountant's and which bound gave it, PLD and RDP, the
    PLD grid) as a JSON-able dict (an infinite ε as ``None``)."""
    out = {"run_id": ledger.run_id, "dataset_size": ledger.dataset_size, "delta": ledger.delta,
           "accountant": ledger.accountant,
           "entries": [e.record() for e in ledger.entries],
           "steps": ledger.steps, "epsilon": ledger.epsilon(), "epsilon_method": ledger.epsilon_bound().method,
           "epsilon_pld": ledger.epsilon(accountant="pld"), "epsilon_rdp": ledger.epsilon(accountant="rdp"),
           "value_discretization_interval": ledger.epsilon_bound(accountant="pld").value_discretization_interval,
           "versions": dict(ledger.versions), "head": ledger.head}
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in out.items()}


def bound_origin(bound) -> str:
    """Which bound gave an epsilon (an :class:`~lightning_dpzero.accounting.EpsilonBound`), in words."""
    if bound.method == "rdp" and bound.pld is not None:
        return f"RDP bound, tighter than the PLD bound {bound.pld!r} here"
    if bound.method == "pld":
        return f"PLD bound on a {bound.value_discretization_interval:g}-nat grid"
    return {"none": "exact: no step, or delta covers the chance an example is ever used",
            "sigma=0": "no noise", "truncation": "the micro-batch truncation takes all of delta"
            }.get(bound.method, bound.method)


def ledger_lines(ledger: "PrivacyLedger", source: str) -> list[str]:
    """The lines ``lightning-dpzero ledger show`` prints for ``ledger`` read from ``source``."""
    samplers = sorted({e.sampler for e in ledger.entries})
    sampler = ", ".join(samplers) or "-"
    if "shuffle" in samplers:
        sampler += " (shuffled fixed-size batches accounted as if Poisson: an approximation)"
    mark = {"pld": "", "rdp": ""}
    mark[ledger.accountant] = "  <- ledger's accountant"
    versions = ", ".join(f"{k} {v}" for k, v in sorted(ledger.versions.items())) or "-"
    from .accountants import truncation_probability

    lines = [f"privacy ledger:   {source}",
             f"run id:           {ledger.run_id}",
             f"dataset size N:   {ledger.dataset_size}{_shards(ledger)}",
             f"delta:            {ledger.delta!r}",
             f"accountant:       {ledger.accountant}",
             f"sampler:          {sampler}",
             f"entries:          {len(ledger.entries)}",
             f"  {'#':>3}  {'q (sample_rate)':>22}  {'sigma (noise_multiplier)':>24}  {'steps':>9}  sampler"]
    lines += [f"  {i:>3}  {e.sample_rate!r:>22}  {e.noise_multiplier!r:>24}  {e.steps:>9}  {e.sampler}"
              for i, e in enumerate(ledger.entries, 1)]
    bounded = [(i, e.micro_batch_bound) for i, e in enumerate(ledger.entries, 1) if e.micro_batch_bound is not None]
    for i, b in bounded:
        lines.append(f"  {i:>3}  micro-batch bound {b.max_micro_batch_size} x {b.accumulate_grad_batches} accumulated "
                     f"over ranks of {', '.join(map(str, b.rank_sizes))} examples: truncated with probability <= "
                     f"{b.exceed_probability(ledger.entries[i - 1].sample_rate):.3g} per step")
    pld = ledger.epsilon_bound(accountant="pld")
    lines += [f"total steps:      {ledger.steps}",
              f"epsilon (pld):    {format_epsilon(pld.epsilon, bool(bounded))}  "
              f"({bound_origin(pld)}, at delta={ledger.delta!r}){mark['pld']}",
              f"epsilon (rdp):    {format_epsilon(ledger.epsilon(accountant='rdp'), bool(bounded))}{mark['rdp']}",
              *([f"truncation:       (1 + e^eps)*p(T) = {pld.truncation_delta:.3g} of delta taken by the "
                 f"micro-batch bound (p(T) = {truncation_probability(ledger.entries):.3g}: the chance any step "
                 "was truncated)"] if bounded and pld.truncation_delta is not None else []),
              f"versions:         {versions}",
              f"hash head:        {ledger.head}"]
    return lines


def epsilon_curve(ledger: "PrivacyLedger", points: int = 100, accountant: Optional[str] = None
                  ) -> tuple[list[int], list[float]]:
    """ε (``compute_epsilon``) after t steps, at about ``points`` step counts t from 0 to the total,
    always including every entry boundary. Returns (steps, epsilons)."""
    from . import LedgerEntry, compute_epsilon

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


def plot_epsilon(ledger: "PrivacyLedger", output, accountants: Sequence[str] = ("pld", "rdp"), points: int = 100,
                 dpi: int = 120, title: Optional[str] = None, target_epsilon: Optional[float] = None) -> Path:
    """Write a PNG of ε against steps for each accountant (PLD solid, RDP dashed), entry boundaries dotted and
    ``target_epsilon`` (if given) as a horizontal line. Returns the path written.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for acc in accountants:
        xs, ys = epsilon_curve(ledger, points, acc)
        ax.plot(xs, ys, "-" if acc == "pld" else "--", label=acc.upper())
    t = 0
    for e in ledger.entries[:-1]:
        t += e.steps
        ax.axvline(t, color="grey", linestyle=":", linewidth=0.8)
    if target_epsilon is not None:
        ax.axhline(target_epsilon, color="red", linewidth=0.8, label=f"target {target_epsilon:g}")
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel(f"epsilon at delta={ledger.delta:g}")
    ax.set_title(title or f"run {ledger.run_id[:12]}  N={ledger.dataset_size}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(output)
    fig.savefig(out, format="png", dpi=dpi)
    return out


def _shards(ledger) -> str:
    """The per-rank shards a pre-sharded run's N is the sum of ('' for one global dataset)."""
    if ledger.shard_sizes is None:
        return ""
    return f" (the sum of {len(ledger.shard_sizes)} ranks' shards: {', '.join(map(str, ledger.shard_sizes))})"
