"""Plan a DP run before training it: the σ, q, steps and ε that ``fit`` will fix (``lightning-dpzero plan``).

Training fixes its privacy plan when the training loader is known (docs/design.md, *Where each piece runs*):
q = B·W·K/N from the loader's ``batch_size`` B, the W processes, K = ``accumulate_grad_batches`` and the dataset
size N; the planned steps from ``max_steps``, or ``max_epochs`` times the optimizer steps of an epoch of the DP
sampler; then :meth:`PrivacyPlan.build <lightning_dpzero.accounting.plan.PrivacyPlan.build>` calibrates σ to the
target ε. :func:`plan_run` does the same from plain numbers with the same ``PrivacyPlan.build``, so the σ it
prints is the one the run then calibrates (bit for bit). It imports dp-accounting, not Lightning or torch.
:func:`settings_from_config` reads the numbers from a Lightning config instead, by instantiating its trainer,
model and datamodule as ``lightning-dpzero fit`` would (nothing trains; no process is launched).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from .accounting.plan import PrivacyPlan


@dataclass(frozen=True)
class PlannedRun:
    """A run's privacy plan and what it spends.

    Attributes:
        plan: the :class:`~lightning_dpzero.accounting.plan.PrivacyPlan` training fixes (σ, q, N, δ, B_exp, steps).
        batch_size: B, the per-device micro-batch of the training loader.
        world_size: W, processes over all nodes.
        accumulate_grad_batches: K.
        micro_batches_per_epoch: micro-batches an epoch of the DP sampler runs (after ``limit_train_batches``).
        steps_per_epoch: optimizer steps per epoch, ``max(micro_batches_per_epoch // K, 1)``.
        epsilon_pld: ε after the planned steps by PLD (None for an unbounded run).
        epsilon_rdp: the same by RDP.
        steps_within_budget: with an explicit σ and a target ε, how many steps fit in the budget (None
            otherwise, or more than 10⁹).
        calibrated: σ was calibrated to the target ε (not given).
    """

    plan: "PrivacyPlan"
    batch_size: int
    world_size: int
    accumulate_grad_batches: int
    micro_batches_per_epoch: int
    steps_per_epoch: int
    epsilon_pld: Optional[float]
    epsilon_rdp: Optional[float]
    steps_within_budget: Optional[int] = None
    calibrated: bool = False

    def to_dict(self) -> dict:
        """JSON-able: the plan's fields and the rest (an infinite ε as ``None``)."""
        out = {**asdict(self.plan), **{k: v for k, v in asdict(self).items() if k != "plan"}}
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in out.items()}


def _sample_rate(batch_size: int, world_size: int, k: int, n: int) -> float:
    """q = B·W·K/N, as ``sampling.poisson_sample_rate`` (both samplers charge it); checked against it in tests."""
    for name, value in (("batch_size", batch_size), ("devices x num_nodes", world_size),
                        ("accumulate_grad_batches", k), ("dataset_size", n)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    q = batch_size * world_size * k / n
    if q > 1:
        raise ValueError(f"Sample rate q = batch_size {batch_size} x devices {world_size} x accumulate_grad_batches "
                         f"{k} / dataset size {n} = {q:.3g} > 1: the logical batch exceeds the dataset.")
    return q


def _micro_batches_per_epoch(n: int, q: float, batch_size: int, world_size: int, k: int, poisson: bool) -> int:
    """``len()`` of the DP batch sampler of one rank: ``DistributedPoissonBatchSampler`` runs max(1, round(1/q))
    steps of K micro-batches; ``DistributedShuffledBatchSampler`` (N // W) // (B·K) steps. Kept equal to the
    samplers by a test over many sizes."""
    if poisson:
        return max(1, round(1.0 / q)) * k
    steps = (n // world_size) // (batch_size * k)
    if steps < 1:
        raise ValueError(f"batch_size={batch_size} x accumulate_grad_batches={k} exceeds the {n // world_size} "
                         f"examples per rank (dataset size {n} over {world_size} devices).")
    return steps * k


def plan_run(dataset_size: int, batch_size: int, *, devices: int = 1, num_nodes: int = 1,
             accumulate_grad_batches: int = 1, max_epochs: Optional[int] = None, max_steps: Optional[int] = None,
             limit_train_batches: Any = 1.0, noise_multiplier: Optional[float] = None,
             target_epsilon: Optional[float] = None, delta: float = 1e-5, accountant: str = "pld",
             poisson_sampling: bool = True, max_micro_batch_size: Optional[int] = None,
             max_examples_per_user: Optional[int] = None, bands: Optional[int] = None,
             noise_mechanism: Optional[str] = None) -> PlannedRun:
    """The privacy plan ``Trainer.fit`` with :class:`~lightning_dpzero.DPDeepSpeedStrategy` fixes, and its ε.

    Args:
        dataset_size: N, examples in the training set (all ranks).
        batch_size: B, the training DataLoader's ``batch_size`` (per device).
        devices: as the Trainer's; W = devices × num_nodes processes.
        num_nodes: as the Trainer's.
        accumulate_grad_batches: K.
        max_epochs: as the Trainer's.
        max_steps: as the Trainer's (``max_steps`` > 0 wins over ``max_epochs``; None or <= 0: not bounded by
            it).
        limit_train_batches: as the Trainer's (an int caps the micro-batches of an epoch, a fraction scales them).
        noise_multiplier: σ; None calibrates it to ``target_epsilon`` over the planned steps.
        target_epsilon: as :class:`~lightning_dpzero.PrivacyAccountantCallback`'s.
        delta: as the callback's.
        accountant: as the callback's (``"pld"`` or ``"rdp"``).
        poisson_sampling: as the strategy's (False: shuffled fixed-size batches, accounted as if Poisson).
        max_micro_batch_size: as the strategy's: b, the most examples of one micro-batch; the truncation's
            (1 + e^ε)·p(T) is taken from δ (``plan.truncation_delta``), over the sampler's split of N over the W
            ranks.
        max_examples_per_user: k, for ``privacy_unit="user"``: dataset_size and batch_size then count users
            (U and users per micro-batch), ε is per user and the plan records the unit. None: example-level.
            Raises ValueError when k < 1.
        bands: b, for ``noise_mechanism="banded-mf"``: cyclic Poisson sampling over b parts, ε of ⌈T/b⌉ rounds at
            rate b·q (None or 1: DP-SGD's accounting); for ``noise_mechanism="blt"``, b >= 2 parts.
        noise_mechanism: as the strategy's; None: ``"banded-mf"`` when ``bands`` > 1, else ``"dp-sgd"``. For
            ``"blt"`` the plan holds the BLT the Trainer optimises for the planned steps (ten epochs when the run
            is unbounded), ε that of one Gaussian mechanism at σ / Δ (not amplified).

    Raises:
        ValueError: what the run would refuse: q > 1, a target without σ for an unbounded run, an explicit σ
            whose ε exceeds the target over the planned steps (naming how many steps fit), no σ and no target,
            a max_micro_batch_size whose truncation takes more than half of δ (naming the smallest that fits).

    Example:
        >>> run = plan_run(60_000, 256, max_epochs=3, noise_multiplier=1.1)
        >>> run.plan.sample_rate == 256 / 60_000, run.plan.planned_steps, round(run.epsilon_pld, 2)
        (True, 702, 0.5)
    """
    from .accounting import BudgetGuard, PrivacyLedger, epsilon_for
    from .accounting.truncation import (MicroBatchBound, check_fixed_size_bound, check_max_micro_batch_size,
                                        rank_sizes_of)
    from .accounting.plan import PrivacyPlan, limited_micro_batches

    world = int(devices) * int(num_nodes)
    k = accumulate_grad_batches
    q = _sample_rate(batch_size, world, k, dataset_size)
    micro = limited_micro_batches(_micro_batches_per_epoch(dataset_size, q, batch_size, world, k, poisson_sampling),
                                  limit_train_batches)
    sampler = "poisson" if poisson_sampling else "shuffle"
    if bands is not None and int(bands) > 1:  # correlated noise: the strategy refuses it with fixed-size batches
        if not poisson_sampling or max_micro_batch_size is not None:
            raise ValueError("bands > 1 (noise_mechanism='banded-mf' or 'blt') needs Poisson sampling without a "
                             "micro-batch bound: drop --no-poisson / --max-micro-batch-size, or --bands.")
        sampler = _correlated_sampler(noise_mechanism, int(bands), micro // k or 1, max_steps, max_epochs)
    elif noise_mechanism == "blt":
        from .blt import check_blt_supported

        check_blt_supported(bands)
    bound = None
    if check_max_micro_batch_size(max_micro_batch_size) is not None:
        if not poisson_sampling:  # fixed-size batches are never truncated: only a b below B is wrong
            check_fixed_size_bound(max_micro_batch_size, batch_size, "batch_size")
        else:
            bound = MicroBatchBound(int(max_micro_batch_size), k, rank_sizes_of(dataset_size, world))
    plan = PrivacyPlan.build(dataset_size=dataset_size, sample_rate=q, sampler_kind=sampler,
                             accumulate_grad_batches=k, micro_batches_per_epoch=micro, max_steps=max_steps,
                             max_epochs=max_epochs, noise_multiplier=noise_multiplier,
                             target_epsilon=target_epsilon, delta=delta, accountant=accountant,
                             micro_batch_bound=bound)
    if max_examples_per_user is not None:  # user-level: dataset_size and batch_size count users, ε is per user
        if int(max_examples_per_user) < 1:
            raise ValueError(f"max_examples_per_user must be >= 1, got {max_examples_per_user}")
        plan = dataclasses.replace(plan, privacy_unit={"unit": "user",
                                                       "max_examples_per_user": int(max_examples_per_user)})
    p = plan.truncation_probability
    eps = {}
    rate, sigma_acc, count = _accounted(q, plan.noise_multiplier, plan.planned_steps or 0, sampler)
    for acc in ("pld", "rdp"):
        eps[acc] = (epsilon_for(sigma_acc, delta, rate, count, acc, truncation=p) if plan.planned_steps else None)
    fits = None
    if target_epsilon is not None and noise_multiplier is not None:
        with contextlib.suppress(ValueError):  # more than 1e9 steps fit: say nothing
            fits = BudgetGuard(target_epsilon).steps_within_budget(PrivacyLedger(delta, dataset_size, accountant),
                                                                   q, plan.noise_multiplier, sampler, bound)
    return PlannedRun(plan, batch_size, world, k, micro, max(micro // k, 1), eps["pld"], eps["rdp"], fits,
                      calibrated=noise_multiplier is None)


def _accounted(q: float, sigma: float, steps: int, sampler: str) -> tuple[float, float, int]:
    """``(q, σ, steps)`` as the accountant composes them (banded MF: its rounds; BLT: one Gaussian at σ / Δ;
    ``accounting/banded.py``)."""
    from .accounting.banded import equivalent_run

    rate, sigma_acc, count = equivalent_run(q, sigma, steps, sampler)
    return rate, sigma_acc, count


def _correlated_sampler(noise_mechanism: Optional[str], bands: int, steps_per_epoch: int,
                        max_steps: Optional[int], max_epochs: Optional[int]) -> str:
    """The ledger sampler a correlated-noise run charges (BLT: with θ, ω optimised as the Trainer does)."""
    from .accounting.banded import cyclic_sampler_kind

    if noise_mechanism != "blt":
        return cyclic_sampler_kind(bands)
    from .accounting.blt import blt_for_run, blt_sampler_kind

    planned = max_steps if max_steps is not None and max_steps > 0 else (
        max_epochs * steps_per_epoch if max_epochs is not None and max_epochs > 0 else None)
    return blt_sampler_kind(bands, blt_for_run(planned, steps_per_epoch, bands))


# ---------------------------------------------------------------------------------------------- from a config
def settings_from_config(cli_args: Sequence[str]) -> dict[str, Any]:
    """:func:`plan_run`'s keyword arguments read from a Lightning config (``["--config", "run.yaml", ...]``, with
    any further ``--config`` files and ``--trainer.x=...`` overrides, as ``lightning-dpzero fit`` takes them).

    Instantiates the trainer, the model and the datamodule as ``fit`` would, then takes N and B from the
    training DataLoader (the datamodule's, else the model's ``train_dataloader``, after ``prepare_data`` and
    ``setup("fit")``), W, K and the step bounds from the trainer, σ and the sampler from the strategy, and the
    target ε, δ and accountant from its ``PrivacyAccountantCallback``.

    Raises:
        ValueError: the config's strategy is not a DP strategy, or its loader has no ``batch_size``.
    """
    from .lightning.cli import build_cli
    from .lightning.callback import PrivacyAccountantCallback
    from .sampling.loader import dataset_size
    from .lightning.strategy import DPDeepSpeedStrategy

    from .accounting.report import quiet_logs

    # the Trainer's banners and "Seed set to": not part of a plan
    with quiet_logs(("lightning.pytorch", "lightning.fabric"), logging.WARNING):
        cli = build_cli(list(cli_args), run=False)
    trainer = cli.trainer
    strategy = trainer.strategy
    if not isinstance(strategy, DPDeepSpeedStrategy):
        raise ValueError(f"the config's strategy is {type(strategy).__name__}, not a DP strategy: set "
                         "trainer.strategy to dp_deepspeed_stage_3 (or class_path: lightning_dpzero.DPDeepSpeedStrategy).")
    source = cli.datamodule if cli.datamodule is not None else cli.model
    source.trainer = trainer  # loaders that read trainer.world_size and the like
    source.prepare_data()
    source.setup("fit")
    loader = source.train_dataloader()
    if getattr(loader, "batch_size", None) is None:
        raise ValueError("the training DataLoader has no batch_size; the DP strategy needs one (q = B·W·K/N).")
    accountant = next((cb for cb in trainer.callbacks if isinstance(cb, PrivacyAccountantCallback)), None)
    settings = accountant.settings if accountant is not None else None
    return {"dataset_size": dataset_size(loader), "batch_size": int(loader.batch_size),
            "devices": trainer.num_devices, "num_nodes": trainer.num_nodes,
            "accumulate_grad_batches": trainer.accumulate_grad_batches, "max_epochs": trainer.max_epochs,
            "max_steps": trainer.max_steps, "limit_train_batches": trainer.limit_train_batches,
            "noise_multiplier": strategy.noise_multiplier, "poisson_sampling": strategy.poisson_sampling,
            **({"max_micro_batch_size": strategy.max_micro_batch_size}
               if strategy.max_micro_batch_size is not None else {}),
            **({"bands": strategy.mechanism.bands, "noise_mechanism": strategy.noise_mechanism}
               if strategy.noise_mechanism != "dp-sgd" else {}),
            **({"target_epsilon": settings.target_epsilon, "delta": settings.delta,
                "accountant": settings.accountant} if settings is not None else {})}


# ---------------------------------------------------------------------------------------------- the command
def _lines(run: PlannedRun) -> list[str]:
    from .accounting.report import format_epsilon

    p = run.plan
    from .accounting.banded import sampler_text

    sampler = sampler_text(p.sampler_kind) + (", accounted as if Poisson" if p.sampler_kind == "shuffle" else "")
    if p.planned_steps is None:
        steps = "unbounded (the budget stops the run)" if p.target_epsilon is not None else "unbounded"
    else:
        steps = f"{p.planned_steps}"
    sigma_note = (f"calibrated: epsilon <= {p.target_epsilon:g} over the planned steps, within 1%" if run.calibrated
                  else "given")
    mark = {"pld": "", "rdp": ""}
    mark[p.accountant] = "  <- the run's accountant"
    unit = p.privacy_unit
    out = [f"dataset size N:         {p.dataset_size}" if unit is None else
           f"users U:                {p.dataset_size} (user-level, at most {unit['max_examples_per_user']} "
           "rows per user; epsilon is per user)",
           f"batch size:             {run.batch_size} per device x {run.world_size} process(es) x "
           f"{run.accumulate_grad_batches} accumulated = {run.batch_size * run.world_size * run.accumulate_grad_batches}",
           f"sample rate q:          {p.sample_rate!r}  ({sampler})",
           f"expected batch q*N:     {p.expected_batch_size:g}",
           f"steps per epoch:        {run.steps_per_epoch}",
           f"planned steps:          {steps}",
           f"delta:                  {p.delta!r}",
           f"target epsilon:         {'-' if p.target_epsilon is None else repr(p.target_epsilon)}",
           f"noise multiplier sigma: {p.noise_multiplier!r}  ({sigma_note})"]
    for acc, eps in (("pld", run.epsilon_pld), ("rdp", run.epsilon_rdp)):
        if eps is not None:
            shown = format_epsilon(eps, p.micro_batch_bound is not None)
            out.append(f"epsilon ({acc}):          {shown}  (after {p.planned_steps} steps){mark[acc]}")
    bound = p.micro_batch_bound
    if bound is not None:
        share = "" if p.truncation_delta is None else (
            f"; truncation takes (1 + e^eps)*p(T) = {p.truncation_delta:.3g} of delta over the planned steps")
        out.append(f"micro-batch bound:      {bound.max_micro_batch_size} per device (a step sample above "
                   f"{bound.max_micro_batch_size * bound.accumulate_grad_batches} per rank is truncated, with "
                   f"probability <= {bound.exceed_probability(p.sample_rate):.3g} per step){share}")
    if run.steps_within_budget is not None:
        out.append(f"steps within budget:    {run.steps_within_budget}  (at this sigma, epsilon <= {p.target_epsilon:g})")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-dpzero plan",
        description="Print the privacy plan a DP run will fix before its first step: sigma (calibrated to the target "
                    "epsilon, or given), q, steps, and epsilon by PLD and RDP. Either give the numbers, or --config "
                    "RUN.yaml (plus any --trainer.x=... overrides, as for `fit`) to read them from a Lightning config; "
                    "numbers given beside --config override it.",
        epilog="example: lightning-dpzero plan --dataset-size 60000 --batch-size 256 --devices 1 --epochs 3 "
               "--target-epsilon 8 --delta 1e-5")
    p.add_argument("--config", action="append", metavar="RUN.yaml",
                   help="a Lightning config, as for `lightning-dpzero fit --config` (may be repeated)")
    p.add_argument("--dataset-size", type=int, help="N, training examples over all ranks")
    p.add_argument("--users", dest="dataset_size", type=int,
                   help="U, users in the training set: user-level DP (with --max-examples-per-user)")
    p.add_argument("--max-examples-per-user", type=int, metavar="K",
                   help="k, rows a sampled user contributes (privacy_unit='user'); N, B and epsilon then count users")
    p.add_argument("--batch-size", type=int, help="B, the training DataLoader's batch_size (per device)")
    p.add_argument("--devices", type=int, help="processes per node (default 1)")
    p.add_argument("--num-nodes", type=int, help="nodes (default 1)")
    p.add_argument("--accumulate", "--accumulate-grad-batches", dest="accumulate_grad_batches", type=int,
                   help="K, accumulate_grad_batches (default 1)")
    p.add_argument("--epochs", "--max-epochs", dest="max_epochs", type=int, help="Trainer(max_epochs)")
    p.add_argument("--max-steps", type=int, help="Trainer(max_steps); wins over --epochs when > 0")
    p.add_argument("--target-epsilon", type=float, help="calibrate sigma to this epsilon over the planned steps")
    p.add_argument("--noise-multiplier", type=float, help="sigma given: print its epsilon (and the steps that fit "
                                                          "a --target-epsilon)")
    p.add_argument("--delta", type=float, help="delta (default 1e-5)")
    p.add_argument("--accountant", choices=["pld", "rdp"], help="the run's accountant (default pld)")
    p.add_argument("--no-poisson", dest="poisson_sampling", action="store_false", default=None,
                   help="shuffled fixed-size batches (poisson_sampling=False)")
    p.add_argument("--max-micro-batch-size", type=int, metavar="B",
                   help="the strategy's max_micro_batch_size: the most examples one micro-batch may hold (the "
                        "truncation's share of delta is reported and sigma calibrated without it)")
    p.add_argument("--bands", type=int, metavar="b",
                   help="noise_mechanism='banded-mf' with b bands: epsilon of ceil(steps/b) rounds at rate b*q")
    p.add_argument("--noise-mechanism", choices=["dp-sgd", "banded-mf", "blt"],
                   help="the strategy's noise_mechanism (default: banded-mf with --bands, else dp-sgd); blt: b = "
                        "--bands cyclic parts, one Gaussian mechanism over the run")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="also draw epsilon against steps up to the planned steps")
    p.add_argument("--points", type=int, default=100, help="about how many step counts the plot evaluates")
    return p


def _ledger_of(run: PlannedRun):
    """A ledger holding the planned steps, to draw the curve with the ledger plot."""
    from .accounting import PrivacyLedger

    p = run.plan
    ledger = PrivacyLedger(p.delta, p.dataset_size, p.accountant, run_id="plan")
    ledger.charge(p.sample_rate, p.noise_multiplier, p.sampler_kind, steps=p.planned_steps, bound=p.micro_batch_bound)
    return ledger


def plan_main(argv: Sequence[str]) -> int:
    """``lightning-dpzero plan ...``: 0 on success, 1 with a message on stderr, 2 for a usage error."""
    parser = _parser()
    args, rest = parser.parse_known_args(list(argv))
    if rest and not args.config:
        parser.error(f"unrecognized arguments: {' '.join(rest)} (Lightning overrides need --config)")
    given = {k: v for k, v in vars(args).items()
             if v is not None and k not in ("config", "json", "plot", "points")}
    from .accounting.report import quiet_logs

    with quiet_logs():
        return _plan_command(parser, args, rest, given)


def _plan_command(parser, args, rest: list[str], given: dict[str, Any]) -> int:
    try:
        settings: dict[str, Any] = {}
        if args.config:
            cli_args = [a for c in args.config for a in ("--config", c)] + rest
            settings = settings_from_config(cli_args)
        settings.update(given)
        missing = [f"--{k.replace('_', '-')}" for k in ("dataset_size", "batch_size") if k not in settings]
        if missing:
            parser.error(f"{' and '.join(missing)} needed (or --config RUN.yaml)")
        if settings.get("max_epochs") is None and settings.get("max_steps") is None:
            parser.error("--epochs or --max-steps needed (or --config RUN.yaml)")
        run = plan_run(**settings)
    except ValueError as exc:
        print(f"lightning-dpzero plan: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(run.to_dict(), indent=2) if args.json else "\n".join(_lines(run)))
    if args.plot:
        if run.plan.planned_steps is None:
            print("lightning-dpzero plan: --plot needs a bounded run (--epochs or --max-steps)", file=sys.stderr)
            return 1
        from .accounting.report import plot_epsilon

        try:
            out = plot_epsilon(_ledger_of(run), args.plot, points=args.points, target_epsilon=run.plan.target_epsilon,
                               title=f"plan: N={run.plan.dataset_size}  q={run.plan.sample_rate:.4g}  "
                                     f"sigma={run.plan.noise_multiplier:.4g}")
        except ImportError:
            print("lightning-dpzero plan: --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 1
        print(f"wrote {out}", file=sys.stderr if args.json else sys.stdout)
    return 0
