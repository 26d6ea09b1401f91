"""What a DP run prints: no FutureWarning from the libraries (DeepSpeed's calls of torch.distributed's deprecated
collectives printed hundreds), none of DeepSpeed's and Lightning's lines a user cannot act on (issue #45, item 4:
``NOISE``), the user's own warnings all the same, and one line with the privacy plan at the start of fit and one
with the ε spent at the end, on rank 0 only.

A user's own script (the quick start's module, ZeRO-3, 2 CPU processes), a Fabric loop (ZeRO-3, 2 processes) and a
YAML run, each a subprocess with Python's default warning filters (no PYTHONWARNINGS), counted line by line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WARNING = re.compile(r"\.py:\d+: ")  # the head of a printed warning

USER_SCRIPT = '''
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dpzero  # noqa: F401
from lightning_dpzero import PrivacyAccountantCallback


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))

    def on_train_start(self):
        warnings.warn("the user's own warning", UserWarning)
        warnings.warn("the user's own future warning", FutureWarning)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


L.seed_everything(0)
x = torch.randn(1024, 16)
y = (x[:, 0] + x[:, 1] > 0).long()
trainer = L.Trainer(strategy="dp_deepspeed_stage_3", accelerator="cpu", devices=2, max_epochs=2,
                    callbacks=[PrivacyAccountantCallback(target_epsilon=8, delta=1e-5)], logger=False,
                    enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
trainer.fit(Classifier(), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
trainer.save_checkpoint("checkpoint")
'''

FABRIC_SCRIPT = '''
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpzero import DPFabricStrategy

torch.manual_seed(0)
data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
strategy = DPFabricStrategy(stage=3, max_grad_norm=1.0, target_epsilon=8.0, delta=1e-5, max_epochs=2)
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
loader = fabric.setup_dataloaders(DataLoader(data, batch_size=32, shuffle=True))
for epoch in range(2):
    for x, y in loader:
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if fabric.strategy.should_stop:
            break
fabric.save("checkpoint", {"model": model, "optimizer": optimizer})
fabric.print(f"epsilon = {fabric.strategy.epsilon():.2f} after {fabric.strategy.ledger.steps} steps")
'''

#: what a DP run printed that its user cannot act on (issue #45, item 4), per rank and run
NOISE = ("Setting accelerator to CPU", "built successfully", "untested optimizer", "Tip:", "`weights_only` was not set",
         "FutureWarning")
LONG_NUMBER = re.compile(r"(sigma|epsilon)=\d+\.\d{7,}")


def _no_noise(lines):
    assert [ln for ln in lines if any(n in ln for n in NOISE) or LONG_NUMBER.search(ln)] == [], "\n".join(lines)


def _output(cmd, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return (proc.stdout + proc.stderr).splitlines()


@pytest.mark.slow
def test_a_users_script_prints_its_own_warnings_and_no_library_noise(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    lines = _output([sys.executable, str(script)], tmp_path)
    _no_noise([ln for ln in lines if "the user's own" not in ln])
    # a warning prints as "file.py:line: Category: message" (Lightning's own without the category) and its source
    warned = [ln for ln in lines if WARNING.search(ln)]
    assert [ln for ln in warned if "the user's own" not in ln] == []
    assert sum("FutureWarning: the user's own future warning" in ln for ln in warned) == 2  # once per rank
    assert sum("UserWarning: the user's own warning" in ln for ln in warned) == 2
    start = [ln for ln in lines if ln.startswith("DP-SGD: sigma=")]
    end = [ln for ln in lines if ln.startswith("DP-SGD: ") and " steps, epsilon=" in ln]
    assert len(start) == 1 and "q=0.0625" in start[0] and "N=1024" in start[0] and "32 planned steps" in start[0]
    assert "target epsilon 8" in start[0] and "delta=1e-05" in start[0] and "expected batch 64" in start[0]
    assert len(end) == 1 and end[0].startswith("DP-SGD: 32 steps, epsilon=") and "target 8" in end[0]


@pytest.mark.slow
def test_a_fabric_loop_prints_no_library_noise(tmp_path):
    """The Fabric strategy filters what the Trainer's does (DeepSpeed's ZeRO-3 collectives printed 49
    FutureWarnings), and neither prints DeepSpeed's or Lightning's per-rank lines a user cannot act on."""
    script = tmp_path / "loop.py"
    script.write_text(FABRIC_SCRIPT)
    lines = _output([sys.executable, str(script)], tmp_path)
    _no_noise(lines)
    assert [ln for ln in lines if WARNING.search(ln)] == []
    assert sum(ln.startswith("epsilon = ") for ln in lines) == 1


@pytest.mark.slow
def test_a_yaml_run_prints_no_future_warning(tmp_path):
    lines = _output([sys.executable, "-m", "lightning_dpzero.cli", "fit", "--config", "examples/configs/digits.yaml",
                     "--trainer.max_epochs=1", "--trainer.check_val_every_n_epoch=1", "--trainer.enable_progress_bar=false",
                     f"--trainer.default_root_dir={tmp_path}"], ROOT)
    # the one warning left is about the config's own setting (strategy seed: 0, for a reproducible example)
    from lightning_dpzero.noise import EXPLICIT_SEED_WARNING

    assert [ln for ln in lines if WARNING.search(ln) and EXPLICIT_SEED_WARNING[:40] not in ln] == []
    assert sum(EXPLICIT_SEED_WARNING[:40] in ln for ln in lines if WARNING.search(ln)) == 1  # rank 0 only
    assert [ln for ln in lines if ln.startswith("WARNING:absl:")] == []  # (test_the_rdp_bound_logs_no_dropped_orders)
    assert sum(ln.startswith("DP-SGD: sigma=") for ln in lines) == 1
    assert any(ln.startswith("DP-SGD: 6 steps") and str(tmp_path / "checkpoints" / "last.ckpt") in ln for ln in lines)


def test_the_rdp_bound_logs_no_dropped_orders(caplog):
    """dp-accounting logs (absl) every fractional Renyi order whose series does not converge and leaves it out; the
    digits config's (q, sigma) printed dozens of these per run. The bound is the library's all the same."""
    import logging

    import dp_accounting

    from lightning_dpzero.accounting import rdp

    q, sigma = 0.17066666666666666, 1.3753574406859959  # examples/configs/digits.yaml's calibrated plan
    rdp._curve.cache_clear()
    with caplog.at_level(logging.WARNING, logger="absl"):
        eps = rdp.rdp_epsilon(((q, sigma, 120),), 1e-5)
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == []
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), 120)
    assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
