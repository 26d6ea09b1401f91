"""``PrivacyAccountantCallback``: calibrates σ from a target ε, logs the spend, keeps the ledger and stops
training before the budget would be exceeded (docs/design.md, *Accounting and the ledger*).

It talks to the strategy's :class:`~lightning_dpzero.mechanism.DPMechanism` only: it hands over its
:class:`~lightning_dpzero.accounting.plan.AccountingSettings` (``use_accounting``), reads ``plan`` and ``ledger``,
takes the clipping statistics (``take_stats``) and hands a ledger from its own state back (``restore_ledger``).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from ..util.collectives import sum_over_ranks
from .epsilon_display import (display_span, float64, log_dp_metric, log_epsilon_bound, log_interval,
                               steps_to_next_log)
from ..util.options import Accountant, AccountingWorker, OnBudgetExhausted, check_flag, check_option
from ..accounting import BudgetGuard, EpsilonTracker, PrivacyBudgetExceeded, PrivacyLedger
from ..accounting.background import AccountingAhead, Answerer, check_accounting_worker, ledger_epsilon
from ..accounting.banded import sampler_text
from ..checkpoints.format import LEDGER_FILE
from ..checkpoints.format import CALLBACK_STATE_KEY
from ..mechanism import DPMechanism
from ..metrics import ClipFraction, MeanGradNorm
from ..accounting.plan import DEFAULT_DELTA, AccountingSettings

__all__ = ["PrivacyAccountantCallback", "PrivacyBudgetExceeded"]

class PrivacyAccountantCallback(Callback):
    """Privacy accounting for a :class:`DPDeepSpeedStrategy` run.

    Args:
        target_epsilon: ε budget. If given, σ is calibrated before the first step so that ε(σ) over the
            planned steps is at most this (and within 1% of it); an explicit σ that exceeds it over a bounded
            run (``max_steps`` / ``max_epochs``) is an error before training. During training no optimizer
            step is ever taken that would make the exact ε of the ledger exceed it (see
            ``on_budget_exhausted``); this matters for unbounded runs, resumed runs whose plan changed, and
            anything else the up-front check cannot foresee.
        delta: δ of the (ε, δ) guarantee (default 1e-5; keep it well below 1/N).
        accountant: ``"pld"`` (privacy loss distributions, tight; default) or ``"rdp"`` (Rényi DP).
        on_budget_exhausted: what to do when the next optimizer step would exceed ``target_epsilon``:
            ``"stop"`` (default) ends training cleanly after the last step that fits (``trainer.should_stop``,
            as early stopping does; checkpoints and ``on_train_end`` run as usual) with a message on rank 0;
            ``"raise"`` raises :class:`PrivacyBudgetExceeded` before that step's first micro-batch. If
            ``min_steps``/``min_epochs`` prevent the stop, the step is refused by raising as well.
        log_second_accountant: also log ε by the other accountant (``epsilon_rdp`` when ``accountant="pld"``,
            ``epsilon_pld`` when ``accountant="rdp"``); the budget is always judged by ``accountant``.
        accounting_worker: where rank 0 computes ε and the budget's answers, ahead of the training loop:
            ``"process"`` (default; a child process, so the step does not wait for dp-accounting), ``"thread"``
            (a thread of the training process), or ``"none"`` (inside the step). The values logged and the budget
            decisions are exactly the same in all three; a step whose answer is not ready waits for it
            (:mod:`lightning_dpzero.accounting.background`).

    After the optimizer steps whose metrics Lightning writes (every ``Trainer(log_every_n_steps=...)``, as
    Lightning's ``LearningRateMonitor`` does, and always the first and the last step of a fit) it logs
    ``epsilon``, ``delta``, ``noise_multiplier``, ``sample_rate`` and ``dp_steps`` (plus ``clip_fraction`` and
    ``mean_grad_norm`` over all ranks' examples of that step) with ``self.log``, so any Lightning logger records
    them (``log_every_n_steps=1``: a row per step; between logged steps ``trainer.callback_metrics`` hold the
    last logged values, and ``dp_steps`` says which step they are of); ε, δ, σ, q and the step count as
    float64, so a logger shows δ = 1e-05, not its float32 neighbour. Every rank computes and logs the same values (no
    ``sync_dist``, so no collective per metric; every rank's ``trainer.callback_metrics`` agree, so a
    ``ModelCheckpoint``/``EarlyStopping`` monitoring ``epsilon`` decides alike everywhere). The logged ε is the
    tracker's upper bound (at most ~2% above the exact value); :meth:`epsilon` gives the exact one. ε is
    0 before the first step, nothing is logged during the sanity check, and with σ = 0 it is ``inf``.

    Between logged steps the callback does no accounting and no collective: at each logged step rank 0 also
    answers how many of the steps up to the next logged one fit the budget (one evaluation at that step count
    covers them, ε being non-decreasing in the steps; near the budget's end, the exact count), and every rank
    agrees on it in the all-reduce that sums the clipping statistics. A step that would exceed the budget is
    never taken, whatever ``log_every_n_steps`` is.
    Its state (saved in every checkpoint) is the ledger.

    Rank 0 prints one line with the privacy plan when training starts (σ, q, expected batch, planned steps,
    target ε, δ, N) and one with the ε spent (the ledger's, and the checkpoint that holds the ledger) when fit
    ends, also by a SIGTERM or an exception. The progress bar shows ``epsilon_bound`` after every step, never below
    the ledger's ε (:mod:`lightning_dpzero.lightning.epsilon_display`).

    Raises:
        TypeError: the trainer's strategy is not a DP strategy (one with a ``mechanism``, a DPMechanism).
        ValueError: bad target_epsilon / delta / accountant / on_budget_exhausted / accounting_worker, when
            constructed.
        PrivacyBudgetExceeded: ``on_budget_exhausted="raise"`` and the next step would exceed the budget.

    Example:
        >>> accountant = PrivacyAccountantCallback(target_epsilon=8.0, delta=1e-5)
        >>> accountant.settings
        AccountingSettings(target_epsilon=8.0, delta=1e-05, accountant='pld')
        >>> accountant.epsilon()  # nothing spent before the first step
        0.0
        >>> PrivacyAccountantCallback(on_budget_exhausted="warn")
        Traceback (most recent call last):
        ...
        ValueError: on_budget_exhausted='warn' is not supported; use one of ('stop', 'raise')...
    """

    def __init__(self, target_epsilon: Optional[float] = None, delta: float = DEFAULT_DELTA,
                 accountant: Accountant = "pld", on_budget_exhausted: OnBudgetExhausted = "stop",
                 log_second_accountant: bool = False, accounting_worker: AccountingWorker = "process"):
        self.settings = AccountingSettings(target_epsilon, delta, accountant)
        self.on_budget_exhausted = check_option(
            "on_budget_exhausted", on_budget_exhausted, OnBudgetExhausted,
            "'stop' ends training after the last step within the budget, 'raise' raises PrivacyBudgetExceeded.")
        self.log_second_accountant = check_flag("log_second_accountant", log_second_accountant)
        self.accounting_worker = check_accounting_worker(accounting_worker)
        self._tracker = EpsilonTracker()
        self._guard = BudgetGuard(target_epsilon, self._tracker) if target_epsilon is not None else None
        # the step's clipping statistics over all ranks: the sums come from the one all-reduce in _decide
        self._clip_fraction = ClipFraction(sync_on_compute=False)
        self._mean_grad_norm = MeanGradNorm(sync_on_compute=False)
        self._logged_steps = -1
        # ε shown after the steps between decision points, a bound for those up to _shown_through (_epsilon_display)
        self._epsilon_shown, self._shown_through, self._epsilon_logged = 0.0, 0, None
        self._first_log_done = False
        self._mechanism: Optional[DPMechanism] = None
        self._ahead: Optional[AccountingAhead] = None  # rank 0, while training
        self._sigma_given = False
        # the ledger's step count up to which every rank agreed (at the last decision) that steps fit the budget
        self._allowed_through = math.inf
        self.budget_exhausted = False    # True once the budget stopped (or refused) a step

    target_epsilon = property(lambda self: self.settings.target_epsilon, doc="The ε budget (None: none).")
    delta = property(lambda self: self.settings.delta, doc="δ of the (ε, δ) guarantee.")
    accountant = property(lambda self: self.settings.accountant, doc='"pld" or "rdp".')

    @property
    @override
    def state_key(self) -> str:
        return CALLBACK_STATE_KEY

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        mechanism = getattr(trainer.strategy, "mechanism", None)
        if not isinstance(mechanism, DPMechanism):
            raise TypeError(f"PrivacyAccountantCallback needs a DP strategy (e.g. strategy='dp_deepspeed_stage_3'), "
                            f"got {type(trainer.strategy).__name__}.")
        self._mechanism = mechanism
        self._sigma_given = mechanism.noise_multiplier is not None  # else the plan calibrates it
        mechanism.use_accounting(self.settings)
        if stage == "fit" and trainer.global_rank == 0 and self._ahead is None:
            self._start_accounting()  # the worker process starts while DeepSpeed initialises

    @property
    def ledger(self) -> Optional[PrivacyLedger]:
        """The run's privacy ledger (None before the plan is fixed)."""
        return self._mechanism.ledger if self._mechanism is not None else None

    @property
    def _plan(self):
        return self._mechanism.plan if self._mechanism is not None else None

    def epsilon(self, exact: bool = True, accountant: Optional[str] = None) -> float:
        """ε spent so far at this callback's δ (0.0 before the first step, ``inf`` if σ = 0 was used), by
        ``accountant`` (default: the callback's). ``exact=False``: the tracker's cheap upper bound."""
        return ledger_epsilon(self.ledger, self._ahead, self._tracker, exact, accountant)

    def _answerer(self) -> Answerer:
        return Answerer(self._tracker, self._guard, self.second_accountant if self.log_second_accountant else None)

    @property
    def second_accountant(self) -> str:
        return "rdp" if self.accountant == "pld" else "pld"

    # ---------------------------------------------------------------------------------------------- budget
    def _exhausted_message(self, trainer) -> str:
        ledger, plan = self.ledger, self._plan
        ask = self._ahead if self._ahead is not None else self._guard
        after = ask.epsilon_after_next_step(ledger, plan.sample_rate, plan.noise_multiplier, plan.sampler_kind,
                                            plan.micro_batch_bound)
        planned = f" of the planned {plan.planned_steps}" if plan.planned_steps else ""
        return (f"Privacy budget exhausted: after {ledger.steps}{planned} optimizer steps ε = "
                f"{self.epsilon():.6g} ({self.accountant}, δ = {self.delta:g}); one more step (q = "
                f"{plan.sample_rate:.6g}, σ = {plan.noise_multiplier:.6g}) would make ε = {after:.6g} > "
                f"target_epsilon = {self.target_epsilon:g}.")

    @staticmethod
    def _run_would_continue(trainer) -> bool:
        """False when the trainer ends anyway after this batch (max_steps reached, or last batch of the last
        epoch): then there is nothing to stop and no message."""
        if trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step:
            return False
        loop = trainer.fit_loop
        last_epoch = (loop.max_epochs is not None and loop.max_epochs >= 0
                      and trainer.current_epoch + 1 >= loop.max_epochs)
        return not (last_epoch and loop.epoch_loop.batch_progress.is_last_batch)

    def _answers(self, trainer, span: int = 1):
        """Rank 0's :class:`StepAnswers` for the ledger as it is (ε to log, how many of the next ``span`` steps
        fit the budget); None on the other ranks, which get them through the all-reduce of :meth:`_decide`."""
        if trainer.global_rank != 0:
            return None
        if self._ahead is None:
            self._start_accounting()
        plan = self._plan
        return self._ahead.answers(self.ledger, plan.sample_rate, plan.noise_multiplier, plan.sampler_kind,
                                   plan.micro_batch_bound, span=span, next_span=log_interval(trainer))

    @property
    def _next_step_allowed(self) -> bool:
        ledger = self.ledger
        return ledger is None or ledger.steps < self._allowed_through

    def _start_accounting(self) -> None:
        self._ahead = AccountingAhead(self._answerer(), self.accounting_worker)

    def _close_accounting(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def _decide(self, trainer, stats: Optional[list[float]] = None, allowed: Optional[float] = None
                ) -> Optional[list[float]]:
        """At a decision point (before the first step, after a logged step, at the end of the steps agreed to
        fit): agree over ranks how many more steps fit (``allowed``: rank 0's count), and reduce this step's
        clipping statistics in the same collective. Returns the summed stats."""
        local = [] if stats is None else list(stats)
        # every rank holds the same ledger: rank 0 alone evaluates the budget (dp-accounting costs milliseconds
        # per new step count) and the all-reduce below hands its answer to the others
        count = float(allowed) if trainer.global_rank == 0 and allowed is not None else 0.0
        if trainer.world_size > 1:
            # every rank reaches the same decision points (they follow from the step counters alone)
            t = torch.tensor(local + [count], dtype=torch.float64, device=trainer.strategy.root_device)
            t = sum_over_ranks(trainer.strategy, t)
            values = t.cpu().tolist()
            local, count = values[:-1], values[-1]
        self._allowed_through = (self.ledger.steps if self.ledger is not None else 0) + count
        if not self._next_step_allowed and self.on_budget_exhausted == "stop" and self._run_would_continue(trainer):
            if not self.budget_exhausted:
                rank_zero_info(self._exhausted_message(trainer) + " Stopping training (on_budget_exhausted='stop').")
            self.budget_exhausted = True
            trainer.should_stop = True
        return local

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self._logged_steps = self.ledger.steps if self.ledger is not None else -1
        self._first_log_done, self._epsilon_logged = False, None
        # the first step is always logged, so it is the next decision point: a span of one step
        answers = self._answers(trainer) if self._plan is not None else None
        self._decide(trainer, allowed=None if answers is None else answers.allowed_steps)
        if self._plan is not None:
            rank_zero_info(self._start_line(trainer))

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._next_step_allowed:
            return
        self.budget_exhausted = True
        message = self._exhausted_message(trainer)
        if self.on_budget_exhausted == "stop":
            message += (f" Training was asked to stop, but Trainer(min_steps={trainer.fit_loop.min_steps}, "
                        f"min_epochs={trainer.fit_loop.min_epochs}) keeps it going; refusing the step. Lower "
                        "min_steps/min_epochs or raise target_epsilon.")
        else:
            message += " Refusing the step (on_budget_exhausted='raise')."
        raise PrivacyBudgetExceeded(message)

    # ---------------------------------------------------------------------------------------------- logging
    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ledger, plan = self.ledger, self._plan
        if trainer.sanity_checking or ledger is None or ledger.steps == self._logged_steps:
            return
        self._logged_steps = ledger.steps
        logs = self._logs_this_step(trainer)
        # nothing to log, and the budget was agreed to allow the next step: no ε, no collective, and the statistics
        # dropped unread (a step of a small model is otherwise slowed by all three: the read waits for the device);
        # shown: the bound agreed at the last decision point
        stats = self._mechanism.take_stats(read=bool(logs or not self._next_step_allowed))
        if stats is None:
            if ledger.steps > self._shown_through:  # (a step past the span the bound was for: computed here, alike
                self._epsilon_shown = self._tracker.epsilon(ledger)  # on every rank; not expected to happen)
            if self._epsilon_shown != self._epsilon_logged:  # (Lightning keeps showing the last value logged)
                self._epsilon_logged = log_epsilon_bound(pl_module, self._epsilon_shown)
            return
        # ε (the tracker's bound; with a budget, never above the target while within it) and the bound to show
        # until the next decision point are computed on rank 0 only and reach the other ranks through the
        # statistics' all-reduce (0 elsewhere: the sum is rank 0's)
        eps = [0.0] * (2 + bool(self.log_second_accountant))
        span = display_span(trainer, steps_to_next_log(trainer))
        self._shown_through = ledger.steps + span
        answers = self._answers(trainer, span)
        if answers is not None:
            eps[0], eps[1] = answers.epsilon, answers.epsilon_ahead
            if self.log_second_accountant:
                eps[2] = answers.epsilon_second
        local = [float(stats.examples), float(stats.clipped), stats.norm_sum]
        examples, clipped, norm_sum, *eps = self._decide(trainer, local + eps,
                                                         None if answers is None else answers.allowed_steps)
        self._epsilon_shown = eps.pop(1)
        self._epsilon_logged = log_epsilon_bound(pl_module, eps[0])  # this step's own
        if not (logs or trainer.should_stop or not self._next_step_allowed):
            return  # (a step after which the budget stops or refuses the next is logged: the last of the fit)
        metrics = {"epsilon": eps[0], "delta": self.delta, "noise_multiplier": plan.noise_multiplier,
                   "sample_rate": plan.sample_rate, "dp_steps": float(ledger.steps)}
        if self.log_second_accountant:
            metrics[f"epsilon_{self.second_accountant}"] = eps[1]
        metrics = {k: float64(pl_module, v) for k, v in metrics.items()}
        if examples:  # the sums over every rank's examples of the step
            metrics["clip_fraction"] = _step_value(self._clip_fraction, clipped, examples)
            # an fp16 overflow (a step DeepSpeed skips) can make a norm inf or NaN: logged as it is
            metrics["mean_grad_norm"] = (_step_value(self._mean_grad_norm, norm_sum, examples)
                                         if math.isfinite(norm_sum) else norm_sum)
        for name, value in metrics.items():
            log_dp_metric(pl_module, name, value)

    def _logs_this_step(self, trainer) -> bool:
        """Whether this step's metrics reach the loggers: Lightning writes per-step metrics every
        ``log_every_n_steps`` (and every step of ``fast_dev_run``) and drops the rest, so the others are not
        logged, as Lightning's ``LearningRateMonitor`` does (each ``self.log`` costs about a millisecond of
        Python, several per step); the first and the last step of a fit always are, so ``callback_metrics`` hold
        every metric from the first step on and end on the final ε."""
        first, self._first_log_done = not self._first_log_done, True  # the metrics exist from the first step on
        return (first or trainer._logger_connector.should_update_logs or bool(trainer.fast_dev_run)
                or trainer.should_stop or not self._run_would_continue(trainer))

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        self._close_accounting()
        if self.budget_exhausted and self.on_budget_exhausted == "stop":
            rank_zero_info(f"Training stopped by the privacy budget after {self.ledger.steps} optimizer steps: "
                           f"ε = {self.epsilon():.6g} <= target_epsilon = {self.target_epsilon:g} "
                           f"(δ = {self.delta:g}).")

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close_accounting()
        if self.ledger is not None and self._plan is not None:  # (a SIGTERM, a refusal: the ε spent, as ever)
            with contextlib.suppress(Exception):  # (never in place of the exception that ended the fit)
                rank_zero_info(self._end_line(trainer))

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._close_accounting()

    @override
    def on_fit_end(self, trainer, pl_module) -> None:
        if self.ledger is not None and self._plan is not None:
            rank_zero_info(self._end_line(trainer))

    # ---------------------------------------------------------------------------------------------- summary lines
    def _start_line(self, trainer) -> str:
        """One line: the plan every step is charged with (rank 0 prints it when training starts)."""
        plan, ledger = self._plan, self.ledger
        if self._sigma_given:
            how = "given"
        else:
            how = f"calibrated to epsilon <= {plan.target_epsilon:g} over the planned steps"
        steps = f"{plan.planned_steps} planned steps" if plan.planned_steps else "no step bound"
        target = f"target epsilon {plan.target_epsilon:g}" if plan.target_epsilon is not None else "no target epsilon"
        line = (f"DP-SGD: sigma={plan.noise_multiplier:.4g} ({how}), q={plan.sample_rate:.6g}, expected batch "
                f"{plan.expected_batch_size:g}, {steps}, {target}, delta={plan.delta:g}, N={plan.dataset_size} "
                f"({plan.accountant}, {sampler_text(plan.sampler_kind)})")
        bound = plan.micro_batch_bound
        if bound is not None:
            share = "" if plan.truncation_delta is None else f", taking {plan.truncation_delta:.3g} of delta"
            line += f"; micro-batches of at most {bound.max_micro_batch_size} (truncation accounted{share})"
        if ledger is not None and ledger.steps:
            line += f"; continuing a ledger of {ledger.steps} steps (epsilon={self.epsilon():.6g})"
        return line

    def _end_line(self, trainer) -> str:
        """One line: the ε spent (the ledger's, as ``ledger show`` prints it) and the checkpoint that holds this
        ledger (rank 0, at the end of fit)."""
        ledger = self.ledger
        target = f", target {self.target_epsilon:g}" if self.target_epsilon is not None else ""
        eps = self.epsilon()
        line = (f"DP-SGD: {ledger.steps} steps, epsilon={'inf' if math.isinf(eps) else f'{eps:.6g}'} "
                f"({self.accountant}) at delta={self.delta:g}{target}")
        found = _checkpoint_with(trainer, ledger)
        if found is not None:
            path, steps = found
            if steps == ledger.steps:
                line += f"; ledger saved in {path} (lightning-dpzero ledger show {path})"
            else:
                line += f"; the last checkpoint, {path}, holds {steps} of the {ledger.steps} steps"
        return line

    # ---------------------------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        ledger = self.ledger
        return {"ledger": ledger.to_dict() if ledger is not None else None, "delta": self.delta,
                "target_epsilon": self.target_epsilon, "accountant": self.accountant}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("ledger")
        if saved is None or self._mechanism is None:
            return
        self._mechanism.restore_ledger(PrivacyLedger.from_dict(saved))


def _checkpoint_with(trainer, ledger: PrivacyLedger) -> Optional[tuple[str, int]]:
    """The newest checkpoint a ``ModelCheckpoint`` of ``trainer`` saved with this run's ledger, and the steps its
    ledger holds (None: no such checkpoint)."""
    best: Optional[tuple[float, str, int]] = None
    for cb in getattr(trainer, "checkpoint_callbacks", []):
        for path in {getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", "")} - {""}:
            json_path = Path(path) / LEDGER_FILE
            try:
                saved = PrivacyLedger.load(json_path)
            except (OSError, ValueError):
                continue
            if saved.run_id == ledger.run_id and (best is None or json_path.stat().st_mtime > best[0]):
                best = (json_path.stat().st_mtime, path, saved.steps)
    return None if best is None else best[1:]


def _step_value(metric, total: float, examples: float) -> float:
    """``metric`` over one step from sums already reduced over the ranks (its own sync is off)."""
    metric.update(total, examples=round(examples))
    value = float(metric.compute())
    metric.reset()
    return value
