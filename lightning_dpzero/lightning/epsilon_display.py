"""The ε the accountant callback shows at every optimizer step: never below the ledger's.

Computing the ledger's ε is a dp-accounting evaluation (a PLD composition, about 60-160 ms on a CPU for the first
fifty step counts), so it happens at the callback's decision points only (the logged steps, docs/privacy.md,
*What is logged*), ahead of the steps on a worker. Each decision point's answer also holds ε after the last step
up to the next decision point (:attr:`~lightning_dpzero.accounting.background.StepAnswers.epsilon_ahead`): ε never
decreases with more steps of the plan, so that value bounds ε after every step in between, and it is the value the
next decision point logs (the same tracker evaluation, cached). The callback logs it as ``epsilon_bound`` (the
progress bar's ε, also in ``trainer.callback_metrics``, not sent to loggers) after each of those steps, and the step's
own ε at each decision point, so the progress bar never shows less than the ledger holds; ``epsilon`` (the loggers'
metric) stays the value of the step ``dp_steps`` names. It is logged when it changes (Lightning keeps showing the
last value logged), so the steps in between compute, exchange and log nothing more than before.
"""

from __future__ import annotations

import torch

#: the metric shown on the progress bar after every step
BOUND = "epsilon_bound"

#: the most steps one budget answer covers (with logging off, the steps between two decision points)
MAX_SPAN = 1000


def float64(pl_module, value: float) -> torch.Tensor:
    """``value`` as a float64 tensor on the module's device: Lightning keeps a tensor's dtype (a Python float would
    be stored as float32, δ = 1e-05 as its float32 neighbour)."""
    return torch.tensor(value, dtype=torch.float64, device=pl_module.device)


def log_epsilon_bound(pl_module, value: float) -> float:
    """Log ``value`` (float64) as ``epsilon_bound``; returns it."""
    log_dp_metric(pl_module, BOUND, float64(pl_module, value))
    return value


def log_dp_metric(pl_module, name: str, value) -> None:
    """The one ``self.log`` call of every privacy metric (Lightning refuses a key logged again with other
    arguments): per step, no ``sync_dist`` (every rank logs the same value); ``epsilon_bound`` on the progress bar
    only (not to the loggers, which get ``epsilon`` at the logged steps)."""
    bar = name == BOUND
    pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=bar, logger=False if bar else None, batch_size=1,
                  sync_dist=False, rank_zero_only=False)


def display_span(trainer, span: int) -> int:
    """``span`` (the steps up to the next logged one) cut at the fit's last step (``Trainer(max_steps=...)``): the
    value shown until then is ε after the last step that can come, so a short fit shows its own final ε, not that
    of steps it will not take. At least 1."""
    max_steps = getattr(trainer, "max_steps", -1)
    if max_steps is not None and max_steps > 0:
        span = min(span, max_steps - int(trainer.global_step))
    return max(int(span), 1)


def log_interval(trainer) -> int:
    """Steps between two logged steps: ``Trainer(log_every_n_steps=...)``, ``MAX_SPAN`` when it is 0 (never)."""
    every = int(getattr(trainer, "log_every_n_steps", 1) or 0)
    return min(every, MAX_SPAN) if every > 0 else MAX_SPAN


def steps_to_next_log(trainer) -> int:
    """Optimizer steps from the one ending now to the next whose metrics Lightning writes (the step counter of
    ``trainer._logger_connector.should_update_logs``), at least 1; the span the budget is asked to cover."""
    every = log_interval(trainer)
    done = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_batches_that_stepped", 0)
    return every - (int(done) + 1) % every
