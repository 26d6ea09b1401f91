"""One rank of a multi-process DP run in a Lightning Fabric loop (launched by ``harness.run_cases(...,
worker="fabric_worker.py")``): the cases of ``dp_worker.py``, trained by ``DPFabricStrategy`` instead of the
Trainer, recording the same files (the indices of every micro-batch, initial and final parameters, the ledger).

Extra case keys: ``use_distributed_sampler`` (of ``fabric.setup_dataloaders``), ``record_ranks`` (every rank
writes its plan and sampler), ``save_path`` (``fabric.save`` after training), ``resume_from`` (``fabric.load``
before the loop; ``load_before_loader``: before ``fabric.setup_dataloaders``), ``expect_error`` (the run must
raise; the message is recorded), ``target_epsilon`` (the loop stops on ``fabric.strategy.should_stop``). The
dataset keys (``shards``, ``batch_sizes``, ``own_rng``) are ``dp_worker.train_dataset``'s.
"""

import json
import os
import sys

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

import lightning_dpzero  # noqa: F401  (registers the strategies)
from lightning_dpzero import DPFabricStrategy

sys.path.insert(0, os.path.dirname(__file__))
from dp_worker import batch_size_of, gathered_params, main, train_dataset  # noqa: E402
from models import build_model  # noqa: E402


class Net(nn.Module):
    """The case's model under the name ``net``, as the Trainer worker's module holds it."""

    def __init__(self, kind):
        super().__init__()
        self.net = build_model(kind)

    def forward(self, x):
        return self.net(x)


def train(case, fabric, model, optimizer, loader, seen, metrics):
    step = 0
    while step < case["steps"] and not fabric.strategy.should_stop:
        for x, y, idx, *_ in loader:
            seen.append([step, [] if fabric.strategy.stand_in_batch else idx.tolist()])  # an empty batch's stand-in
            out = model(x)
            loss = (out * 0.0).sum() / max(len(x), 1) if case.get("zero_loss") else nn.functional.cross_entropy(out, y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            metrics.append(fabric.strategy.privacy_metrics)
            if step >= case["steps"] or fabric.strategy.should_stop:
                break
    return step


def run_case(case, out_dir, devices):
    strategy = DPFabricStrategy(
        stage=case["stage"], noise_multiplier=case["sigma"], max_grad_norm=float(case["C"]),
        clipping=case["clipping"], clipping_fn=case["clipping_fn"], poisson_sampling=case["poisson"],
        clipping_groups=case.get("clipping_groups"), clipping_mode=case.get("clipping_mode", "book-keeping"),
        seed=case.get("seed", 1234),
        secure_mode=case.get("secure_mode", False), target_epsilon=case.get("target_epsilon"),
        max_steps=case["steps"])
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision=case.get("precision", "32-true"))
    fabric.launch()
    torch.manual_seed(case.get("init_seed", 0))
    raw = Net(case["model"])
    init = {n: p.detach().clone() for n, p in raw.named_parameters()}
    optimizer = torch.optim.SGD(raw.parameters(), lr=case["lr"])
    model, optimizer = fabric.setup(raw, optimizer)
    rank = fabric.global_rank
    train_loader = DataLoader(train_dataset(case, rank), batch_size=batch_size_of(case, rank), shuffle=True)
    seen, metrics, error = [], [], None
    try:
        if case.get("resume_from") and case.get("load_before_loader"):
            fabric.load(case["resume_from"], {"model": model, "optimizer": optimizer})
        loader = fabric.setup_dataloaders(train_loader,
                                          use_distributed_sampler=case.get("use_distributed_sampler", True))
        if case.get("resume_from") and not case.get("load_before_loader"):
            fabric.load(case["resume_from"], {"model": model, "optimizer": optimizer})
        steps = train(case, fabric, model, optimizer, loader, seen, metrics)
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        if not case.get("expect_error"):
            raise
        error, steps = f"{type(exc).__name__}: {exc}", 0
    if case.get("save_path"):
        fabric.save(case["save_path"], {"model": model, "optimizer": optimizer, "step": steps})
    final = gathered_params(raw, case["stage"])
    rank, name = fabric.global_rank, case["name"]
    with open(os.path.join(out_dir, f"{name}.seen{rank}.json"), "w") as f:
        json.dump(seen, f)
    with open(os.path.join(out_dir, f"{name}.metrics{rank}.json"), "w") as f:
        json.dump(metrics, f)
    torch.save(final, os.path.join(out_dir, f"{name}.final{rank}.pt"))
    if case.get("record_ranks") and strategy.plan is not None:  # every rank: its plan and the examples it samples
        with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as f:
            json.dump({"plan": vars(strategy.plan), "sampler_examples": len(strategy._loader.batch_sampler.shard),
                       "sample_rate": strategy._loader.batch_sampler.sample_rate}, f)
    if rank == 0:
        ledger = strategy.ledger
        torch.save({"init": init, "final": final, "error": error,
                    "ledger": ledger.to_dict() if ledger is not None else None,
                    "global_step": strategy.steps.taken, "steps_this_run": steps,
                    "plan": vars(strategy.plan) if strategy.plan is not None else None,
                    "epsilon": strategy.epsilon(), "should_stop": strategy.should_stop},
                   os.path.join(out_dir, f"{name}.pt"))


if __name__ == "__main__":
    main(run_case)
