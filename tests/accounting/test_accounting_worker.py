"""The accountant callback's worker (lightning_dpzero.accounting.background): answers computed ahead of the steps,
in a child process or a thread, are exactly the answers computed in the step, for every ledger the run passes
through (a growing run, the end of the budget, a plan that changes), and a worker that dies is replaced by
computing in the training process, never by a guess."""

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dpzero  # noqa: F401
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback, PrivacyLedger
from lightning_dpzero.accounting import BudgetGuard, EpsilonTracker
from lightning_dpzero.accounting.background import AccountingAhead, Answerer, ledger_view

Q, SIGMA, TARGET = 0.125, 2.0, 1.0  # the budget runs out after 9 steps (tests/lightning/test_budget.py)


def _sync_answers(ledger, plans, second=None):
    """The reference: a fresh tracker and guard asked in the step, in order (as the callback did before)."""
    tracker = EpsilonTracker()
    guard = BudgetGuard(TARGET, tracker)
    out = []
    for plan in plans:
        eps = guard.epsilon_upper_bound(ledger) if ledger.steps else 0.0
        eps2 = (tracker.epsilon(ledger, accountant=second) if ledger.steps else 0.0) if second else None
        out.append((eps, eps2, guard.allows_next_step(ledger, *plan)))
        ledger.charge(*plan)
    return out


@pytest.mark.parametrize("worker", ["process", "thread", "none"])
def test_answers_ahead_are_the_answers_in_the_step(worker):
    # 12 steps at (Q, SIGMA) then 6 at another plan: past the budget's end, and a new entry of the ledger
    plans = [(Q, SIGMA, "poisson")] * 12 + [(0.25, 3.0, "poisson")] * 6
    expected = _sync_answers(PrivacyLedger(1e-5, 64), plans, second="rdp")
    tracker = EpsilonTracker()
    ahead = AccountingAhead(Answerer(tracker, BudgetGuard(TARGET, tracker), "rdp"), worker)
    ledger, got = PrivacyLedger(1e-5, 64), []
    try:
        for plan in plans:
            got.append(tuple(ahead.answers(ledger, *plan))[:3])  # (the 4th, epsilon_ahead: test_epsilon_display.py)
            ledger.charge(*plan)
        assert ahead.epsilon(ledger) == ledger.epsilon()
        assert ahead.epsilon_after_next_step(ledger, *plans[-1]) == BudgetGuard(TARGET).epsilon_after_next_step(
            ledger, *plans[-1])
    finally:
        ahead.close()
    assert got == expected
    allowed = [a for _, _, a in got[:12]]
    assert allowed == [True] * 9 + [False] * 3  # 9 steps fit: yes before each of them, no before the 10th
    assert all(e2 >= e for e, e2, _ in got[1:])  # RDP above PLD


def test_the_logged_epsilon_is_tightened_to_the_target_whatever_was_asked_before():
    """An answer is a pure function of its ledger: asked alone (a fresh answerer, nothing computed before) near
    the end of the budget, it is the value the ordered computation logs there, tightened to the exact ε where
    the tracker's grid point would exceed the target."""
    from lightning_dpzero.accounting import compute_epsilon

    q, sigma, grid = 0.02, 1.0, EpsilonTracker()
    last = next(n for n in range(60, 200) if grid.grid_point(n) != n)  # the tracker is not exact here
    target = compute_epsilon(_ledger_of(q, sigma, last).entries, 1e-5)
    plan = (q, sigma, "poisson")
    tracker = EpsilonTracker()
    guard = BudgetGuard(target, tracker)
    ledger, ordered = PrivacyLedger(1e-5, 1000), {}
    for n in range(last + 2):  # the callback's order: ε of the ledger, then the budget for the next step
        ordered[n] = (guard.epsilon_upper_bound(ledger) if n else 0.0, None, guard.allows_next_step(ledger, *plan))
        ledger.charge(*plan)
    assert ordered[last][2] is False and ordered[last - 1][2] is True  # `last` steps fit exactly
    assert ordered[last][0] == target < EpsilonTracker().epsilon(_ledger_of(q, sigma, last))
    for n in (last - 2, last - 1, last, last + 1):
        fresh = EpsilonTracker()
        alone = Answerer(fresh, BudgetGuard(target, fresh), None).answer(ledger_view(_ledger_of(q, sigma, n)), plan)
        assert tuple(alone)[:3] == ordered[n], n


def _ledger_of(q, sigma, steps):
    ledger = PrivacyLedger(1e-5, 1000)
    ledger.charge(q, sigma, steps=steps)
    return ledger


def test_a_worker_process_that_dies_is_replaced_by_computing_here():
    tracker = EpsilonTracker()
    ahead = AccountingAhead(Answerer(tracker, BudgetGuard(TARGET, tracker), None), "process")
    plans = [(Q, SIGMA, "poisson")] * 12
    expected = _sync_answers(PrivacyLedger(1e-5, 64), plans)
    ledger, got = PrivacyLedger(1e-5, 64), []

    def step(plan):
        got.append(tuple(ahead.answers(ledger, *plan))[:3])
        ledger.charge(*plan)

    try:
        step(plans[0])  # answered here: the child is still starting
        ahead._pool._ready.result(timeout=300)  # now it has started
        step(plans[1])  # one answer from the child, and the next ones queued to it
        ahead._pool._proc.kill()  # the child is gone (killed, out of memory, ...)
        ahead._pool._proc.wait()
        with pytest.warns(RuntimeWarning, match="accounting continues inside the training step"):
            while len(got) < len(plans):
                step(plans[len(got)])
        assert ahead._pool is None
    finally:
        ahead.close()
    assert got == expected


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.seen = {}  # dp_steps -> the epsilon in callback_metrics after that step

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def on_train_batch_end(self, *args):  # after the callback's own hook
        metrics = self.trainer.callback_metrics
        if "epsilon" in metrics:
            self.seen[int(metrics["dp_steps"])] = float(metrics["epsilon"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)),
                          batch_size=2)


@pytest.mark.parametrize("worker", ["process", "thread", "none"])
def test_a_budget_stopped_run_logs_and_stops_alike_with_every_worker(worker):
    model, cb = Net(), PrivacyAccountantCallback(target_epsilon=TARGET, accounting_worker=worker)
    trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=SIGMA), accelerator="cpu", devices=1,
                        max_steps=-1, max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb], accumulate_grad_batches=2, log_every_n_steps=1)
    trainer.fit(model)
    reference = _sync_answers(PrivacyLedger(1e-5, 32), [(Q, SIGMA, "poisson")] * 10)
    assert trainer.global_step == cb.ledger.steps == 9 and cb.budget_exhausted
    assert model.seen == {n: reference[n][0] for n in range(1, 10)}  # every step's logged ε, bit for bit
    assert model.seen[9] <= TARGET
    assert cb._ahead is None  # the worker is gone after fit


def test_metrics_are_logged_at_the_trainers_logging_steps_and_the_first_and_last():
    """Lightning writes per-step metrics every log_every_n_steps and drops the rest: the callback logs those
    steps, the first (the keys exist from then on) and the last (callback_metrics end on the final ε), each
    with the same value as a run that logs every step."""
    def run(every):
        model = Net()
        trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=SIGMA, seed=3), accelerator="cpu",
                            devices=1, max_steps=10, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[PrivacyAccountantCallback(delta=1e-5)], log_every_n_steps=every)
        trainer.fit(model)
        return model.seen, float(trainer.callback_metrics["epsilon"])
    every_step, last_all = run(1)
    sparse, last_sparse = run(4)
    assert sorted(every_step) == list(range(1, 11))
    assert sorted(sparse) == [1, 4, 8, 10]
    assert sparse == {n: every_step[n] for n in (1, 4, 8, 10)}
    assert last_sparse == last_all == every_step[10]


@pytest.mark.parametrize("worker", ["process", "none"])
def test_between_logged_steps_there_is_no_accounting_and_no_collective(worker, monkeypatch):
    """The budget is asked at the logged steps for the steps up to the next one (one evaluation covers them) and
    at the end of the stretch it allowed, so a run logging every 4th step decides at 5 points, not at each of its
    9 steps, and stops where a run deciding at every step stops, with the same ε at the steps both log."""
    decided = []
    real = PrivacyAccountantCallback._decide

    def counting(self, trainer, *args, **kwargs):
        decided.append(self.ledger.steps)
        return real(self, trainer, *args, **kwargs)

    monkeypatch.setattr(PrivacyAccountantCallback, "_decide", counting)

    def run(every):
        decided.clear()
        model, cb = Net(), PrivacyAccountantCallback(target_epsilon=TARGET, accounting_worker=worker)
        trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=SIGMA), accelerator="cpu",
                            devices=1, max_steps=-1, max_epochs=-1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                            accumulate_grad_batches=2, log_every_n_steps=every)
        trainer.fit(model)
        assert trainer.global_step == cb.ledger.steps == 9 and cb.budget_exhausted
        return model.seen, list(decided)

    every_step, decided_every = run(1)
    sparse, decided_sparse = run(4)
    assert decided_every == list(range(10))  # before the first step, then after each
    # before the first step; after the first (always logged), the 4th and the 8th; at the 9th, where the stretch
    # allowed at the 8th (the budget's exact end, found there) runs out and the budget stops the run
    assert decided_sparse == [0, 1, 4, 8, 9]
    assert sorted(sparse) == [1, 4, 8, 9]
    assert sparse == {n: every_step[n] for n in (1, 4, 8, 9)}


def test_one_budget_answer_covers_a_span_and_ends_at_the_exact_count():
    """``answer(view, plan, span)``: ``span`` while the ledger ``span`` steps on is within the budget, then the
    exact number of steps left (9 fit in all), never more than ``span``; ``inf`` without a budget."""
    plan = (Q, SIGMA, "poisson")
    for span in (1, 3, 50):
        tracker = EpsilonTracker()
        answerer = Answerer(tracker, BudgetGuard(TARGET, tracker), None)
        for n in range(12):
            ledger = _ledger_of(Q, SIGMA, n) if n else PrivacyLedger(1e-5, 1000)
            got = answerer.answer(ledger_view(ledger), plan, span).allowed_steps
            assert got == min(span, max(9 - n, 0)), (span, n)
    assert Answerer(EpsilonTracker(), None, None).answer(ledger_view(_ledger_of(Q, SIGMA, 3)), plan, 5) \
        .allowed_steps == float("inf")


def test_the_step_before_a_refused_one_is_logged_whatever_the_logging_interval():
    """With on_budget_exhausted="raise" the fit ends at the refused step's start: the step before it is the last
    of the fit, so callback_metrics end on its ε even between logged steps."""
    from lightning_dpzero import PrivacyBudgetExceeded

    model = Net()
    cb = PrivacyAccountantCallback(target_epsilon=TARGET, on_budget_exhausted="raise", accounting_worker="none")
    trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=SIGMA), accelerator="cpu", devices=1,
                        max_steps=-1, max_epochs=-1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                        accumulate_grad_batches=2, log_every_n_steps=4)
    with pytest.raises(PrivacyBudgetExceeded):
        trainer.fit(model)
    assert cb.ledger.steps == 9 and sorted(model.seen) == [1, 4, 8, 9]
    assert float(trainer.callback_metrics["dp_steps"]) == 9
