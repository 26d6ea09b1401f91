"""One rank of a multi-process DP run that checkpoints every optimizer step and can die by SIGKILL.

Launched by ``crash_harness.launch`` the way torchrun would (one process per rank, env:// rendezvous). Every
case of the JSON case list runs in order (one ``Trainer.fit`` each). Case options:

* ``kill = {"rank": r, "at": point, "step": k, "match": "..."}``: rank r sends itself SIGKILL (no cleanup, no
  ``finally``) at ``point`` of optimizer step k:
  ``"step"``: inside the optimizer step, after the ledger charge and the noise, before the update;
  ``"shard"``: while DeepSpeed writes a checkpoint file whose path contains ``match`` (the first ``keep`` fraction
  of its bytes, default 0.5, is on disk; ``keep=0``: before the file is touched, so an older file stays);
  ``"commit"``: after the shards and ``privacy_ledger.json``, just before ``privacy_commit.json``;
* ``resume_from``: ``ckpt_path`` of the fit; an exception is recorded (type, message) instead of failing;
* ``ckpt_dir``: ModelCheckpoint(every step, ``step=K.ckpt``, plus ``last.ckpt`` overwritten in place);
* ``accumulate``, ``limit_train_batches``, ``max_epochs``: the Trainer's (``steps=-1`` with ``max_epochs``);
* ``on_exception_dir``: ``OnExceptionCheckpoint`` into that directory (``on_exception.ckpt``);
* ``save_path``: ``trainer.save_checkpoint`` there after the fit;
* ``slow_step``: seconds every training_step sleeps (on rank ``slow_rank`` only, if given: the other ranks then
  wait for it inside the next collective, where a signal handler running a collective would deadlock them).

A SIGTERM ends the fit with Lightning's ``SIGTERMException`` (a ``SystemExit``): recorded like an exception.
Every rank's record also holds DeepSpeed's ``global_steps`` and the seconds from the fit's start to its end.

Rank 0 writes the parameters after every optimizer step to ``<out>/<name>.traj/<step>.pt`` (before that step's
checkpoint is written), and every rank ``<out>/<name>.rank<r>.json`` at the end of a case.
"""

import io
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from models import build_model, make_dataset  # noqa: E402

import lightning_dpzero  # noqa: E402,F401
import lightning_dpzero.checkpoints.protocol as protocol_module  # noqa: E402
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback  # noqa: E402

STATE = {"trainer": None, "case": None}


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_here(point):
    kill, trainer = STATE["case"].get("kill"), STATE["trainer"]
    if not kill or kill["at"] != point or trainer is None or trainer.global_rank != kill["rank"]:
        return False
    return trainer.global_step == kill["step"] - (1 if point == "step" else 0)


class Module(L.LightningModule):
    def __init__(self, case):
        super().__init__()
        self.case = case
        self.net = build_model(case["model"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.case.get("slow_step") and self.global_rank == self.case.get("slow_rank", self.global_rank):
            time.sleep(self.case["slow_step"])  # one slow rank: the others wait for it inside a collective
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.case["lr"])

    def train_dataloader(self):
        x, y = make_dataset(self.case["model"], self.case["n"])
        return DataLoader(TensorDataset(x, y), batch_size=self.case["batch_size"], shuffle=True)


class Recorder(L.Callback):
    """Parameters after every optimizer step (rank 0; ZeRO stage <= 2 keeps full parameters on every rank)."""

    def __init__(self, out_dir, name):
        self.dir = Path(out_dir) / f"{name}.traj"

    def on_train_start(self, trainer, pl_module):
        STATE["trainer"] = trainer
        if trainer.is_global_zero:
            self.dir.mkdir(parents=True, exist_ok=True)
            if trainer.global_step == 0:
                self._save(0, pl_module)
            (self.dir / "started").touch()
        base = trainer.strategy.deepspeed_engine.optimizer
        while not isinstance(base, torch.optim.Optimizer):
            base = base.optimizer
        base.register_step_pre_hook(lambda *args: die() if kill_here("step") else None)  # after the noise hook

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.is_global_zero:
            self._save(trainer.global_step, pl_module)

    def _save(self, step, pl_module):
        state = {n: p.detach().clone().float() for n, p in pl_module.named_parameters()}
        tmp = self.dir / f".{step}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.dir / f"{step}.pt")


def install_write_kills():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    original_save = TorchCheckpointEngine.save

    def save(self, state_dict, path):
        kill = STATE["case"].get("kill") or {}
        if kill_here("shard") and kill.get("match", "") in str(path):
            keep = kill.get("keep", 0.5)
            if keep:
                buf = io.BytesIO()
                torch.save(state_dict, buf)
                data = buf.getvalue()
                with open(path, "wb") as f:  # a write cut in the middle, as a kill during torch.save leaves it
                    f.write(data[: int(len(data) * keep)])
                    f.flush()
                    os.fsync(f.fileno())
            die()  # keep=0: dies before touching the file (an older file of that name stays as it was)
        return original_save(self, state_dict, path)

    TorchCheckpointEngine.save = save
    # the checkpoint protocol calls the marker writer by the name it imported from lightning_dpzero.checkpoints.commit
    name = next((n for n in ("write_commit", "_write_commit") if hasattr(protocol_module, n)), None)
    if name is None:
        raise RuntimeError("lightning_dpzero.checkpoints.protocol has no write_commit: update crash_worker's commit "
                           "kill point")
    original_commit = getattr(protocol_module, name)

    def write_commit(directory, commit):
        if kill_here("commit"):
            die()
        return original_commit(directory, commit)

    setattr(protocol_module, name, write_commit)


def run_case(case, out_dir, devices):
    STATE["case"], STATE["trainer"] = case, None
    L.seed_everything(case.get("init_seed", 0), verbose=False)
    module = Module(case)
    accountant = PrivacyAccountantCallback(delta=1e-5)
    callbacks = [accountant, Recorder(out_dir, case["name"])]
    if case.get("ckpt_dir"):
        callbacks.append(ModelCheckpoint(dirpath=case["ckpt_dir"], filename="{step}", every_n_train_steps=1,
                                         save_top_k=-1, save_last=True))
    if case.get("on_exception_dir"):
        callbacks.append(OnExceptionCheckpoint(case["on_exception_dir"]))
    strategy = DPDeepSpeedStrategy(stage=case["stage"], noise_multiplier=case["sigma"], max_grad_norm=case["C"],
                                   seed=case.get("seed", 1234))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=case["steps"],
                        max_epochs=case.get("max_epochs"), accumulate_grad_batches=case.get("accumulate", 1),
                        limit_train_batches=case.get("limit_train_batches"),
                        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=out_dir)  # Lightning's own checkpoints: not the cwd
    result = {"ok": True}
    start = time.monotonic()
    try:
        trainer.fit(module, ckpt_path=case.get("resume_from"))
        if case.get("save_path"):
            trainer.save_checkpoint(case["save_path"])
    except (Exception, SystemExit) as exc:  # recorded for the test: a refusal must be the same error on every rank
        result = {"ok": False, "error_type": type(exc).__name__, "error": str(exc),
                  "traceback": traceback.format_exc()[-3000:]}
    ledger = strategy.ledger
    engine = getattr(strategy, "deepspeed_engine", None)
    result.update(seconds=time.monotonic() - start,
                  deepspeed_global_steps=int(engine.global_steps) if engine is not None else None)
    result.update(global_step=trainer.global_step, ledger=ledger.to_dict() if ledger is not None else None,
                  epsilon=float(accountant.epsilon()) if ledger is not None else None,
                  plan=dict(vars(strategy.plan)) if strategy.plan is not None else None)
    with open(os.path.join(out_dir, f"{case['name']}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


def main():
    cases = json.loads(Path(sys.argv[1]).read_text())
    out_dir = sys.argv[2]
    install_write_kills()
    devices = int(os.environ.get("WORLD_SIZE", "1"))
    for case in cases:
        run_case(case, out_dir, devices)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


if __name__ == "__main__":
    main()
