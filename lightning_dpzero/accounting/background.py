"""The accountant callback's per-step questions, answered ahead of the steps by a worker.

At the steps where it decides (the steps whose metrics are logged, and the end of the stretch of steps the
budget was last known to allow) the callback needs ε of the ledger (the tracker's upper bound, to log) and how
many more steps of the plan the budget allows, up to the next such step (the *span*). Early in a run each answer
is a new dp-accounting evaluation (a PLD composition, milliseconds); computed inside the step they delay it
(docs/design.md, *Accounting and the ledger*). :class:`AccountingAhead` has a worker compute them for the next few
decision points while the steps run: every step of a run charges the plan's (q, σ, sampler), so the ledger after
k more steps is known in advance.

* The worker is a child process by default (``"process"``: it holds no lock the training loop needs, so the
  step does not slow down while it computes), or a thread (``"thread"``: shares the interpreter lock with the
  training loop), or none (``"none"``: every answer computed when asked, in the step).
* Each question is asked of a frozen copy of the ledger (:class:`LedgerView`), never of the live one, and an
  answer is used only for the ledger it was computed for (same entries, δ and accountant).
* An answer is a pure function of that ledger and the plan (:meth:`Answerer.answer`), so it is the same whoever
  computes it and in whatever order; it is exactly what the callback computed inside the step before.
* If the answer for the current ledger is not ready, the step waits for it: the budget decision before a step
  is never guessed, and the logged ε is never below the true one. A worker that fails is replaced by computing
  in the calling process (with a warning), never by a guess.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional

from ..util.options import AccountingWorker, check_option
from .accountants import EpsilonTracker
from .budget import BudgetGuard
from .ledger import LedgerEntry
from .truncation import MicroBatchBound, bound_fields


@dataclass(frozen=True)
class LedgerView:
    """A frozen ledger as the tracker and the guard read it: entries, δ, accountant."""

    entries: tuple
    delta: float
    accountant: str

    @property
    def steps(self) -> int:
        return sum(e.steps for e in self.entries)

    @property
    def key(self) -> tuple:
        return (tuple(_fields(e) for e in self.entries), self.delta, self.accountant)

    def after(self, steps: int, sample_rate: float, noise_multiplier: float, sampler: str,
              *bound: Any) -> "LedgerView":
        """The view after ``steps`` more charges of (q, σ, sampler, bound fields b, K, rank sizes), merged as
        :meth:`PrivacyLedger.charge` does."""
        entries = list(self.entries)
        last = entries[-1] if entries else None
        grown = _entry((float(sample_rate), float(noise_multiplier), steps, sampler, *bound))
        if last is not None and _fields(last)[:2] + _fields(last)[3:] == _fields(grown)[:2] + _fields(grown)[3:]:
            entries[-1] = _entry((*_fields(last)[:2], last.steps + steps, *_fields(last)[3:]))
        else:
            entries.append(grown)
        return LedgerView(tuple(entries), self.delta, self.accountant)


def _fields(e) -> tuple:
    """An entry as a hashable tuple (q, σ, steps, sampler, b, K, rank sizes); the last three None without a bound."""
    sizes = getattr(e, "rank_sizes", None)
    return (e.sample_rate, e.noise_multiplier, e.steps, e.sampler, getattr(e, "max_micro_batch_size", None),
            getattr(e, "accumulate_grad_batches", None), None if sizes is None else tuple(sizes))


def _entry(fields) -> LedgerEntry:
    return LedgerEntry(*fields)


def plan_args(plan: tuple) -> tuple:
    """``(q, σ, sampler, bound)`` for the guard from a plan tuple ``(q, σ, sampler[, b, K, rank sizes])``."""
    q, s, sampler, *rest = plan
    bound = MicroBatchBound(*rest) if rest and rest[0] is not None else None
    return q, s, sampler, bound


def plan_tuple(sample_rate: float, noise_multiplier: float, sampler: str, bound: Optional[MicroBatchBound]) -> tuple:
    """The hashable, JSON-able plan tuple of :func:`plan_args`."""
    return (float(sample_rate), float(noise_multiplier), sampler, *bound_fields(bound))


def ledger_view(ledger) -> LedgerView:
    """A frozen copy of ``ledger`` (a :class:`~lightning_dpzero.PrivacyLedger` or any object with ``entries``,
    ``delta`` and ``accountant``)."""
    return LedgerView(tuple(_entry(_fields(e)) for e in ledger.entries), ledger.delta, ledger.accountant)


class StepAnswers(NamedTuple):
    """What the callback needs after a step (or before the first), for the ledger as it is then."""

    epsilon: float                   #: the value to log (0.0 for an empty ledger)
    epsilon_second: Optional[float]  #: the other accountant's, when asked for
    allowed_steps: float             #: how many more steps of the plan fit the budget, counted up to the span
    #: (0: not the next one; ``inf`` without a budget)
    #: ε (as ``epsilon``) after the last of the next ``span`` steps that fit the budget: an upper bound on ε after
    #: each of them, shown until the next decision point (lightning_dpzero.lightning.epsilon_display)
    epsilon_ahead: float = 0.0

    @property
    def allows_next_step(self) -> bool:
        """The budget's exact answer for one more step of the plan."""
        return self.allowed_steps > 0


class Answerer:
    """The computations themselves, on one tracker and one guard (used by one thread at a time).

    Args:
        tracker: the :class:`EpsilonTracker` whose bounds are logged.
        guard: the :class:`BudgetGuard` (None: no budget).
        second_accountant: also answer ε by this accountant, or None.
    """

    def __init__(self, tracker: EpsilonTracker, guard: Optional[BudgetGuard], second_accountant: Optional[str]):
        self.tracker, self.guard, self.second = tracker, guard, second_accountant

    def settings(self) -> dict:
        """What a worker process needs to build an equal answerer (:meth:`from_settings`); its caches are not
        sent: an answer is a pure function of its ledger, recomputed there."""
        t = self.tracker
        return {"growth": t.growth, "exact_below": t.exact_below,
                "target_epsilon": None if self.guard is None else self.guard.target_epsilon, "second": self.second}

    @classmethod
    def from_settings(cls, settings: dict) -> "Answerer":
        tracker = EpsilonTracker(growth=settings["growth"], exact_below=settings["exact_below"])
        target = settings["target_epsilon"]
        return cls(tracker, None if target is None else BudgetGuard(target, tracker), settings["second"])

    def answer(self, view: LedgerView, plan: tuple, span: int = 1) -> StepAnswers:
        """How many of the next ``span`` steps of ``plan`` = (q, σ, sampler) fit the budget, then ε of ``view``.
        Asking the budget first makes ε independent of which answers were computed before: when the tracker's
        bound is over the target the guard has then found the exact largest step count that fits, and the logged
        ε is tightened to the exact ε there (:meth:`BudgetGuard.epsilon_upper_bound`), as it always was in
        order."""
        allowed = math.inf if self.guard is None else self._allowed(view, plan, int(span))
        if view.steps == 0:  # (before the first step, which is a decision point: nothing shown ahead of it)
            return StepAnswers(0.0, 0.0 if self.second else None, allowed)
        eps = self._logged_epsilon(view)
        eps2 = self.tracker.epsilon(view, accountant=self.second) if self.second else None
        ahead = int(min(int(span), allowed))  # the last step up to the next decision point that can be taken
        return StepAnswers(eps, eps2, allowed, self._logged_epsilon(view.after(ahead, *plan)) if ahead > 0 else eps)

    def _logged_epsilon(self, view: LedgerView) -> float:
        return self.guard.epsilon_upper_bound(view) if self.guard is not None else self.tracker.epsilon(view)

    def _allowed(self, view: LedgerView, plan: tuple, span: int) -> int:
        """``span`` when the ledger after ``span`` more steps is within the budget (ε is non-decreasing in the
        steps, so every step before fits as well: one evaluation covers the span), else the exact count that
        fits (:meth:`BudgetGuard.steps_within_budget`, found once per plan), at most ``span``."""
        args = plan_args(plan)
        if self.guard.allows_next_step(view.after(span - 1, *plan) if span > 1 else view, *args):
            return span
        return min(span, self.guard.steps_within_budget(view, *args))

    def epsilon(self, view: LedgerView, exact: bool, accountant: Optional[str]) -> float:
        return self.tracker.epsilon(view, exact=exact, accountant=accountant) if view.steps else 0.0

    def epsilon_after_next_step(self, view: LedgerView, plan: tuple) -> float:
        return self.guard.epsilon_after_next_step(view, *plan_args(plan))



def _encode(value: Any) -> Any:
    """A request's or an answer's arguments as JSON values (views as their entries; Infinity allowed)."""
    if isinstance(value, LedgerView):
        return {"view": [_encode(_fields(e)) for e in value.entries],
                "delta": value.delta, "accountant": value.accountant}
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def _decode_view(data: dict) -> LedgerView:
    return LedgerView(tuple(_entry(fields) for fields in data["view"]), data["delta"], data["accountant"])


def _write(stream, obj) -> None:
    stream.write(json.dumps(obj).encode() + b"\n")
    stream.flush()


class WorkerLost(RuntimeError):
    """The accounting worker process exited (or could not start)."""


class _ProcessPool:
    """One child process that runs :class:`Answerer` methods, with ``concurrent.futures``-like ``submit``.

    Requests and answers travel as JSON lines over two pipes of its own (the child's stdout and stderr stay the
    user's; nothing is unpickled); answers come back in order and a reader thread resolves their futures. The
    child exits when the request pipe closes, so it never outlives the training process."""

    def __init__(self, answerer: Answerer):
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        code = f"from lightning_dpzero.accounting.background import _serve; _serve({req_r}, {res_w})"
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(req_r, res_w), env=env,
                                          stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            os.close(req_r)
            os.close(res_w)
        self._requests = os.fdopen(req_w, "wb")
        self._results = os.fdopen(res_r, "rb")
        self._futures: list = []  # (method, future) in the order sent
        self._lock = threading.Lock()
        self._lost: Optional[str] = None
        self._reader = threading.Thread(target=self._read, name="dp-accounting-results", daemon=True)
        self._reader.start()
        self._ready = self.submit("init", answerer.settings())  # the child builds its own tracker and guard

    @property
    def ready(self) -> bool:
        """The child has started and holds its copy of the answerer (before that, answer in this process)."""
        return self._ready.done() and self._ready.exception() is None

    def submit(self, method: str, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # sent is running: cancel() is then a no-op, never a race with _read
        with self._lock:
            if self._lost is None:
                try:
                    _write(self._requests, [method, _encode(args)])
                    self._futures.append((method, future))
                    return future
                except (OSError, ValueError) as exc:
                    self._lost = f"cannot send to the accounting worker: {exc}"
            future.set_exception(WorkerLost(self._lost))
        return future

    def _read(self) -> None:
        while True:
            try:
                line = self._results.readline()
                if not line:
                    raise EOFError
                ok, value = json.loads(line)
            except (EOFError, OSError, ValueError) as exc:
                with self._lock:
                    self._lost = self._lost or f"the accounting worker process exited ({type(exc).__name__})"
                    pending, self._futures = self._futures, []
                for _, future in pending:
                    future.set_exception(WorkerLost(self._lost))
                return
            with self._lock:
                method, future = self._futures.pop(0)
            if not ok:
                future.set_exception(RuntimeError(f"accounting worker: {value}"))
            elif method == "answer":
                future.set_result(StepAnswers(*value))
            else:
                future.set_result(value)

    def shutdown(self) -> None:
        """Stop the child now: it holds nothing that is not recomputed from the ledger."""
        with self._lock:
            self._lost = self._lost or "closed"
        try:
            self._requests.close()
        except OSError:
            pass
        self._proc.kill()
        self._proc.wait()
        self._reader.join(timeout=5)
        self._results.close()


def _serve(req_fd: int, res_fd: int) -> None:
    """The worker process: answer ``[method, args]`` JSON lines in order until the pipe closes."""
    requests, results = os.fdopen(req_fd, "rb"), os.fdopen(res_fd, "wb")
    answerer: Optional[Answerer] = None
    for line in requests:
        method, args = json.loads(line)
        try:
            if method == "init":
                answerer, value = Answerer.from_settings(args[0]), None
            else:
                value = getattr(answerer, method)(_decode_view(args[0]), *[
                    tuple(a) if isinstance(a, list) else a for a in args[1:]])
            reply = [True, list(value) if isinstance(value, tuple) else value]
        except Exception as exc:  # noqa: BLE001 - handed back to the training process, which raises it
            reply = [False, f"{type(exc).__name__}: {exc}"]
        _write(results, reply)


def check_accounting_worker(value: Any) -> AccountingWorker:
    """``value`` if it names a worker kind (the ``accounting_worker`` setting of the callback and of the Fabric
    strategy), else ``ValueError``."""
    return check_option("accounting_worker", value, AccountingWorker,
                        "'process' computes ε ahead of the steps in a child process, 'thread' in a thread, "
                        "'none' in the step.")


def ledger_epsilon(ledger, ahead: Optional["AccountingAhead"], tracker: EpsilonTracker, exact: bool = True,
                   accountant: Optional[str] = None) -> float:
    """ε of ``ledger`` (0.0 without steps): asked of ``ahead`` while it runs (its worker holds the tracker; the
    answer comes after its queue), else of ``tracker``."""
    if ledger is None or ledger.steps == 0:
        return 0.0
    if ahead is not None:
        return ahead.epsilon(ledger, exact, accountant)
    return tracker.epsilon(ledger, exact=exact, accountant=accountant)


class AccountingAhead:
    """Answers :class:`StepAnswers` for a growing ledger, ``lookahead`` decision points ahead, on a worker.

    Args:
        answerer: the computations (the callback's tracker and guard); a ``"process"`` worker gets a copy of it
            and this one computes in this process if the child fails.
        worker: ``"process"`` (default), ``"thread"`` or ``"none"`` (see the module).
        lookahead: how many decision points ahead of the ledger to queue (default 4).

    Call :meth:`answers` with the live ledger and the plan's (q, σ, sampler) at each decision point,
    :meth:`epsilon` and :meth:`epsilon_after_next_step` for other questions, and :meth:`close` at the end of
    training.
    """

    def __init__(self, answerer: Answerer, worker: AccountingWorker = "process", lookahead: int = 4):
        self.answerer, self.lookahead = answerer, int(lookahead)
        self._pool: Any = None
        if worker == "process":
            try:
                self._pool = _ProcessPool(answerer)
            except (OSError, ValueError) as exc:  # no fork/exec here, or no pass_fds (not POSIX)
                self._lose(f"cannot start the accounting worker process: {exc}")
        elif worker == "thread":
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp-accounting")
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self.waited = 0  #: answers the step had to wait for (not ready when asked; diagnostics)

    def _lose(self, why: str) -> None:
        warnings.warn(f"{why}; privacy accounting continues inside the training step (same values, slower).",
                      RuntimeWarning, stacklevel=3)
        if self._pool is not None and hasattr(self._pool, "shutdown"):
            self._pool.shutdown()
        self._pool = None

    def _ahead(self) -> bool:
        """Whether a worker can take questions now (a child process only once it has started)."""
        return self._pool is not None and (not isinstance(self._pool, _ProcessPool) or self._pool.ready)

    def _submit(self, method: str, *args) -> concurrent.futures.Future:
        if self._ahead():
            if isinstance(self._pool, _ProcessPool):
                return self._pool.submit(method, *args)
            return self._pool.submit(getattr(self.answerer, method), *args)
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(getattr(self.answerer, method)(*args))
        except Exception as exc:  # noqa: BLE001 - re-raised by .result() in the caller
            future.set_exception(exc)
        return future

    def _result(self, future: concurrent.futures.Future, method: str, *args) -> Any:
        try:
            return future.result()
        except WorkerLost as exc:
            self._lose(str(exc))
            self._pending.clear()
            return getattr(self.answerer, method)(*args)

    def answers(self, ledger, sample_rate: float, noise_multiplier: float, sampler: str,
                bound: Optional[MicroBatchBound] = None, span: int = 1, next_span: Optional[int] = None
                ) -> StepAnswers:
        """The answers for ``ledger`` as it is now and the next ``span`` steps of the plan (q, σ, sampler,
        bound), waiting for them if they are not ready; queued behind them, those of the next ``lookahead``
        decision points, ``span`` steps from now and then every ``next_span`` (default ``span``) steps, each
        asked for ``next_span`` steps."""
        plan = plan_tuple(sample_rate, noise_multiplier, sampler, bound)
        view, span = ledger_view(ledger), int(span)
        future = self._pending.pop((view.key, plan, span), None)
        if future is None:
            future = self._submit("answer", view, plan, span)
        if not future.done():
            self.waited += 1
        result = self._result(future, "answer", view, plan, span)
        if self._ahead():  # (a child still starting gets no questions: they are answered here meanwhile)
            every = int(next_span or span)
            ahead = [view.after(span + j * every, *plan) for j in range(self.lookahead)]
            keys = {(v.key, plan, every) for v in ahead}
            for stale in [k for k in self._pending if k not in keys]:  # queued for a ledger that did not come
                self._pending.pop(stale).cancel()
            for v in ahead:
                if (v.key, plan, every) not in self._pending:
                    self._pending[(v.key, plan, every)] = self._submit("answer", v, plan, every)
        return result

    def epsilon(self, ledger, exact: bool = True, accountant: Optional[str] = None) -> float:
        """ε of ``ledger`` (exact, or the tracker's bound), computed after the queued answers."""
        view = ledger_view(ledger)
        return self._result(self._submit("epsilon", view, exact, accountant), "epsilon", view, exact, accountant)

    def epsilon_after_next_step(self, ledger, sample_rate: float, noise_multiplier: float, sampler: str,
                                bound: Optional[MicroBatchBound] = None) -> float:
        """Exact ε of ``ledger`` with one more step (q, σ, sampler, bound) charged."""
        view, plan = ledger_view(ledger), plan_tuple(sample_rate, noise_multiplier, sampler, bound)
        return self._result(self._submit("epsilon_after_next_step", view, plan), "epsilon_after_next_step",
                            view, plan)

    def close(self) -> None:
        """Drop the queued answers and stop the worker."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if isinstance(self._pool, _ProcessPool):
            self._pool.shutdown()
        elif self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None
