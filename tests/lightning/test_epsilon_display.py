"""The ε shown at every optimizer step (progress bar, ``trainer.callback_metrics``) is never below the ledger's, and
the final line (also after a SIGTERM) reads the ledger (docs/privacy.md, *What is logged*)."""

import os
import re
import signal

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 2)

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)),
                          batch_size=8)


class Shown(Callback):
    """After the accountant (and before the progress bar) at each step: what the bar shows, and the ledger's ε."""

    def __init__(self, accountant, sigterm_at=None):
        self.accountant, self.sigterm_at, self.rows = accountant, sigterm_at, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        ledger = self.accountant.ledger
        self.rows.append((ledger.steps, float(trainer.progress_bar_metrics["epsilon_bound"]),
                          float(trainer.callback_metrics["epsilon_bound"]), ledger.epsilon()))
        if ledger.steps == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(steps, sigterm_at=None, **accounting):
    L.seed_everything(0, verbose=False)
    accountant = PrivacyAccountantCallback(accounting_worker="none", **accounting)
    shown = Shown(accountant, sigterm_at)
    trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), accelerator="cpu", devices=1,
                        max_steps=steps, log_every_n_steps=50, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[accountant, shown])
    return trainer, accountant, shown


@pytest.mark.parametrize("accounting", [{}, {"target_epsilon": 30.0}])
def test_the_epsilon_shown_after_every_step_is_never_below_the_ledgers(accounting):
    """log_every_n_steps=50, 5 steps: ε shown after each step, not only after the logged ones (1 and 5), and it is
    at least the ledger's; exactly the ledger's at the logged steps; between them, ε after the fit's last step."""
    trainer, accountant, shown = _fit(5, **accounting)
    trainer.fit(Net())
    assert [r[0] for r in shown.rows] == [1, 2, 3, 4, 5]
    for steps, bar, metric, ledger in shown.rows:
        assert bar == metric >= ledger > 0, (steps, bar, ledger)
    first, *middle, last = shown.rows
    assert first[1] == pytest.approx(first[3], rel=1e-9) and last[1] == pytest.approx(last[3], rel=1e-9)
    assert all(r[1] == pytest.approx(last[3], rel=1e-9) for r in middle)  # the bound: ε after step 5


def test_after_a_sigterm_the_final_line_reads_the_ledger(caplog):
    trainer, accountant, shown = _fit(20, sigterm_at=3)
    with caplog.at_level("INFO"), pytest.raises(BaseException) as raised:  # Lightning exits after a SIGTERM
        trainer.fit(Net())
    assert "SIGTERM" in type(raised.value).__name__ or isinstance(raised.value, SystemExit), raised.value
    steps = accountant.ledger.steps
    assert 3 <= steps < 20 and all(r[1] >= r[3] for r in shown.rows)  # (stops after the step under way)
    line = next(m for m in caplog.messages if m.startswith(f"DP-SGD: {steps} steps, epsilon="))
    assert float(re.search(r"epsilon=([0-9.e+-]+)", line).group(1)) == pytest.approx(accountant.ledger.epsilon(),
                                                                                       rel=1e-5)
