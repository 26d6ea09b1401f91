"""Refusals before any process starts, printed once (issue #45, items 2 and 5).

A refusal that needs no process group (the Trainer's and DeepSpeed's settings, the model's layers, the training
loader's sampler and q, σ against the target ε, fp16 on the CPU) is raised in the launching process before
Lightning's launcher starts the other ranks; in-process tests here run ``devices=2`` with the launcher made to fail
if it is reached. A refusal found on the ranks prints once, message first (subprocess tests, slow)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

import lightning_dpzero  # noqa: F401
from lightning_dpzero import DPDeepSpeedStrategy, DPFabricStrategy, PrivacyAccountantCallback, UnsupportedLayerError

ROOT = Path(__file__).resolve().parents[2]


class Launched(Exception):
    """The launcher was reached: the refusal did not come before it."""


@pytest.fixture(autouse=True)
def _launcher_must_not_run(monkeypatch):
    def launched(self):
        raise Launched("Lightning's launcher was about to start the other ranks")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", launched)


class Net(L.LightningModule):
    def __init__(self, body=None):
        super().__init__()
        self.body = body or nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Manual(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


def _data(n=64):
    return TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))


def _fit(model=None, loader=None, strategy=None, callbacks=(), **trainer_kw):
    trainer = L.Trainer(strategy=strategy or DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), accelerator="cpu",
                        devices=2, max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks), **trainer_kw)
    trainer.fit(model or Net(), loader if loader is not None else DataLoader(_data(), batch_size=4))


REFUSED = {
    "batchnorm": (dict(model=Net(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))),
                  UnsupportedLayerError, r"BatchNorm1d 'body\.1'.*lightning_dpzero\.fix_model\(model\)"),
    "gradient_clip_val": (dict(gradient_clip_val=1.0), ValueError, r"gradient_clip_val=1.0.*max_grad_norm"),
    # manual optimization itself runs (tests/lightning/test_manual_optimization.py); what of it is refused, before launch
    "manual_optimization": (dict(model=Manual(), accumulate_grad_batches=2), ValueError,
                            r"accumulate_grad_batches=2\) with automatic_optimization=False"),
    "custom_sampler": (dict(loader=DataLoader(_data(), batch_size=4,
                                              sampler=WeightedRandomSampler(torch.ones(64), 64))),
                       ValueError, r"custom sampler torch\.utils\.data\.sampler\.WeightedRandomSampler"),
    "sigma_too_small": (dict(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=0.3),
                             callbacks=[PrivacyAccountantCallback(target_epsilon=1.0)]),
                        ValueError, r"noise_multiplier=0.3 gives ε=.* > target_epsilon=1.0.*no step fits at this σ"),
    "no_sigma_no_target": (dict(strategy=DPDeepSpeedStrategy(stage=2)), ValueError, "No noise multiplier"),
    "sample_rate_above_one": (dict(loader=DataLoader(_data(16), batch_size=16)), ValueError, r"q = batch_size 16"),
}


@pytest.mark.parametrize("fit_kw, error, match", REFUSED.values(), ids=REFUSED.keys())
def test_what_needs_no_process_group_is_refused_before_the_launcher_starts_anything(fit_kw, error, match):
    start = time.perf_counter()
    with pytest.raises(error, match=match):
        _fit(**fit_kw)
    print(f"refused in {time.perf_counter() - start:.2f} s")  # measured, not asserted


class BuiltOnTheRanks(Net):
    """A head that ``configure_model`` builds (on each rank, e.g. under ZeRO-3's sharded init)."""

    def configure_model(self):
        if not hasattr(self, "head"):
            self.head = nn.Linear(2, 2)


def test_a_valid_fit_reaches_the_launcher_with_the_model_as_it_was():
    model = Net()
    with pytest.raises(Launched):
        _fit(model, callbacks=[PrivacyAccountantCallback(target_epsilon=8.0)])
    assert not any("forward" in m.__dict__ for m in model.modules())  # the layer check detached the engine
    # clipping groups naming layers that only the ranks build are the ranks' to form
    with pytest.raises(Launched):
        _fit(BuiltOnTheRanks(), strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0, clipping="group-wise",
                                                             clipping_groups=[["body.*"], ["head.*"]]))
    with pytest.raises(Launched):  # a loader Lightning's sampler injection rebuilds is left to the ranks
        _fit(loader=DataLoader(_data(), batch_sampler=torch.utils.data.BatchSampler(range(64), 4, False)))


@pytest.mark.parametrize("precision, config", [("16-mixed", None), ("32-true", {"fp16": {"enabled": True}})])
def test_fp16_on_the_cpu_is_refused_when_the_trainer_or_fabric_is_built(precision, config, monkeypatch):
    import deepspeed

    # DeepSpeed's CPU accelerator runs fp16 where oneDNN has fp16 kernels for the CPU, and refuses it elsewhere:
    # the check follows it, here on a CPU without them.
    monkeypatch.setattr(type(deepspeed.accelerator.get_accelerator()), "is_fp16_supported", lambda self: False)
    match = r"fp16, which DeepSpeed's CPU accelerator does not support.*precision='bf16-mixed'"
    with pytest.raises(ValueError, match=match):
        L.Trainer(strategy=DPDeepSpeedStrategy(noise_multiplier=1.0, config=config), accelerator="cpu",
                  devices=1, precision=precision, logger=False)
    with pytest.raises(ValueError, match=match):
        Fabric(strategy=DPFabricStrategy(noise_multiplier=1.0, config=config), accelerator="cpu", devices=1,
               precision=precision)


# ------------------------------------------------------------------------------------ printed once, message first
TRAINER_SCRIPT = '''
import lightning as L, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_dpzero import DPDeepSpeedStrategy

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    def training_step(self, batch, _):
        return nn.functional.cross_entropy(self.body(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), accelerator="cpu", devices=2,
                    max_epochs=1, logger=False, enable_checkpointing=False, gradient_clip_val=GRADIENT_CLIP_VAL)
trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=4))
'''

FABRIC_SCRIPT = '''
import torch
from lightning.fabric import Fabric
from torch import nn
from lightning_dpzero import DPFabricStrategy

fabric = Fabric(accelerator="cpu", devices=2, strategy=DPFabricStrategy(stage=2, noise_multiplier=1.0))
fabric.launch()
net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
'''


def _run(tmp_path, script: str) -> tuple[int, list[str], float]:
    """Exit status, the lines printed (without the "[rankN]: " torch puts in front of an uncaught exception once
    the process group is up), and the seconds it took."""
    path = tmp_path / "train.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [re.sub(r"^\[rank\d+\]: ", "", ln) for ln in (proc.stdout + proc.stderr).splitlines()]
    return proc.returncode, lines, time.perf_counter() - start


def _once_and_first(lines: list[str], head: str) -> None:
    """``head`` (the exception line) is printed once, before any frame of the traceback."""
    assert sum(ln.startswith(head) for ln in lines) == 1, "\n".join(lines)
    at = next(i for i, ln in enumerate(lines) if ln.startswith(head))
    assert not any(ln.startswith(("Traceback", "  File ")) for ln in lines[:at]), "\n".join(lines)
    assert lines[at + 1:].count("Raised at (most recent call last):") == 1


@pytest.mark.slow
@pytest.mark.parametrize("clip, head", [("None", "lightning_dpzero.per_sample.base.UnsupportedLayerError: "),
                                        ("1.0", "ValueError: Trainer(gradient_clip_val=1.0)")])
def test_a_trainer_refusal_on_two_devices_comes_before_any_process_starts_and_prints_once(tmp_path, clip, head):
    rc, lines, seconds = _run(tmp_path, TRAINER_SCRIPT.replace("GRADIENT_CLIP_VAL", clip))
    print(f"refused after {seconds:.1f} s")  # measured, not asserted
    assert rc != 0
    _once_and_first(lines, head)
    assert not any("initializing deepspeed distributed" in ln or "[rank: 1]" in ln for ln in lines), "\n".join(lines)


@pytest.mark.slow
def test_a_refusal_on_the_ranks_of_a_fabric_run_prints_once_message_first(tmp_path):
    rc, lines, seconds = _run(tmp_path, FABRIC_SCRIPT)
    print(f"refused after {seconds:.1f} s")
    assert rc != 0
    _once_and_first(lines, "lightning_dpzero.per_sample.base.UnsupportedLayerError: ")
    assert "stopped: UnsupportedLayerError (rank 0 prints the message)" in lines


def test_a_refusal_raised_in_any_folder_of_the_package_is_one():
    """The refusal report recognises the package's own exceptions wherever they are raised (the per-example engine,
    the options, the strategy), not only next to the report's own file."""
    from lightning_dpzero.lightning.refusal_report import is_refusal
    from lightning_dpzero.util.options import LossReduction, check_option

    with pytest.raises(ValueError) as raised:
        check_option("loss_reduction", "avg", LossReduction)
    assert is_refusal(raised.value)
    try:
        raise ValueError("a user's own error")
    except ValueError as exc:
        assert not is_refusal(exc)
