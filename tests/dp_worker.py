"""One rank of a multi-process DP run for the invariant tests (launched by ``harness.run_cases``).

Every rank runs each case of the JSON case list in order (one ``Trainer.fit`` per case, the process group
reused) and writes what it saw: the indices of every micro-batch, and (rank 0) the initial and final
parameters, the ledger and the step count. The tests rebuild the expected update from those records.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import lightning as L
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_dpzero  # noqa: F401  (registers the strategies)
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback

sys.path.insert(0, os.path.dirname(__file__))
from models import build_model, make_dataset  # noqa: E402


class IndexedDataset(Dataset):
    """The examples ``start, start+1, ...`` of the data set, each with its index in the whole data set."""

    def __init__(self, x, y, start=0):
        self.x, self.y, self.start = x, y, start

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], torch.tensor(self.start + i)


class OwnRandomDataset(IndexedDataset):
    """An ``IndexedDataset`` whose examples carry a fourth item from an unseeded generator of its own (an
    augmentation the global seeds do not fix): two ranks holding the same data read different values."""

    def __init__(self, x, y, start=0):
        super().__init__(x, y, start)
        self.rng = np.random.default_rng()

    def __getitem__(self, i):
        return (*super().__getitem__(i), torch.tensor(self.rng.random()))


def train_dataset(case, rank):
    """The case's training dataset on ``rank``: its shard (``shards``: [[start, stop] per rank]) or all of it,
    ``own_rng``: with an augmentation from the dataset's own generator."""
    x, y = make_dataset(case["model"], case["n"])
    start, stop = case["shards"][rank] if case.get("shards") else (0, case["n"])
    cls = OwnRandomDataset if case.get("own_rng") else IndexedDataset
    data = cls(x[start:stop], y[start:stop], start)
    if case.get("users"):  # user-level DP: the row's user
        data.user_ids = case["users"][start:stop]
    return data


def batch_size_of(case, rank):
    """The case's micro-batch on ``rank`` (``batch_sizes``: one per rank)."""
    return case["batch_sizes"][rank] if case.get("batch_sizes") else case["batch_size"]


class Module(L.LightningModule):
    def __init__(self, case):
        super().__init__()
        self.case = case
        self.net = build_model(case["model"])
        self.seen = []

    def on_train_batch_start(self, batch, batch_idx):
        # here, not in training_step, which the strategy's layout check runs twice more (once re-indexed)
        self.seen.append([int(self.global_step), batch[2].tolist()])

    def training_step(self, batch, batch_idx):
        x, y, idx = batch[:3]
        out = self.net(x)
        if self.case.get("zero_loss"):
            return (out * 0.0).sum() / max(len(x), 1)
        loss = nn.functional.cross_entropy(out, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, batch_size=len(x))
        return loss

    def configure_optimizers(self):
        if self.case.get("opt_groups"):  # optimizer parameter groups by name patterns (group-wise clipping)
            import fnmatch

            named = list(self.named_parameters())
            groups = [[p for n, p in named if any(fnmatch.fnmatchcase(n, s) for s in pats)]
                      for pats in self.case["opt_groups"]]
            return torch.optim.SGD([{"params": g} for g in groups], lr=self.case["lr"])
        return torch.optim.SGD(self.parameters(), lr=self.case["lr"])

    def train_dataloader(self):
        return DataLoader(train_dataset(self.case, self.global_rank), shuffle=True,
                          batch_size=batch_size_of(self.case, self.global_rank))


class ManualModule(Module):
    """The same step in manual optimization (``automatic_optimization = False``), as users write it; with
    ``case["closure"]`` the backward runs in ``opt.step(closure)``."""

    def __init__(self, case):
        super().__init__(case)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        if self.case.get("closure"):
            def closure():
                loss = Module.training_step(self, batch, batch_idx)
                self.manual_backward(loss)
                return loss
            return opt.step(closure=closure)
        loss = Module.training_step(self, batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        return loss


class StopAt(L.Callback):
    """Stops the run after ``step`` optimizer steps, as an interruption would (the plan stays max_steps)."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class CountBarriers(L.Callback):
    """Counts the ``torch.distributed.barrier`` calls inside each training batch (from its start hook to the end of
    every callback's end hook: this callback runs last), and writes the counts per batch to ``path``."""

    def __init__(self, path):
        self.path, self.counts, self._inside = path, [], False
        self._barrier = torch.distributed.barrier

        def counting(*args, **kwargs):
            if self._inside:
                self.counts[-1] += 1
            return self._barrier(*args, **kwargs)

        torch.distributed.barrier = counting

    def on_train_batch_start(self, *args):
        self.counts.append(0)
        self._inside = True

    def on_train_batch_end(self, *args):
        self._inside = False

    def teardown(self, *args, **kwargs):
        torch.distributed.barrier = self._barrier
        with open(self.path, "w") as f:
            json.dump(self.counts, f)


class PeakGathered(L.Callback):
    """The most parameter elements ZeRO-3 holds gathered at once in a backward pass, over the fit: read after each
    of its coordinator's fetches from a module's backward (DeepSpeed 0.19's ``fetch_sub_module``)."""

    def __init__(self):
        self.peak, self.model = 0, None

    def setup(self, trainer, module, stage):
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coord

        self.model, self._fetch = module, Coord.fetch_sub_module

        def fetch(coord, submodule, forward, *args, **kwargs):
            out = self._fetch(coord, submodule, forward, *args, **kwargs)
            if not forward:
                self.peak = max(self.peak, sum(p.ds_numel for p in self.model.parameters()
                                               if p.ds_status.name == "AVAILABLE"))
            return out

        Coord.fetch_sub_module = fetch

    def teardown(self, trainer, module, stage):
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coord

        Coord.fetch_sub_module = self._fetch


class EveryStep(L.Callback):
    """The parameters before the first step and after each one (``case["record_steps"]``)."""

    def __init__(self, stage):
        self.stage, self.params = stage, []

    def on_train_start(self, trainer, module):
        self.params.append(gathered_params(module, self.stage))

    def on_train_batch_end(self, trainer, module, *args):
        self.params.append(gathered_params(module, self.stage))


def gathered_params(model, stage):
    params = list(model.parameters())
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def allow_fp16_on_deepspeed_cpu():
    """Let DeepSpeed's CPU accelerator run fp16 (it refuses it, though PyTorch's CPU kernels run fp16): DeepSpeed's
    fp16 code path (fp16 weights, fp32 master weights, the loss scale) then runs end to end without a GPU."""
    import deepspeed.accelerator

    cls = type(deepspeed.accelerator.get_accelerator())
    cls.is_fp16_supported = lambda self: True


def run_case(case, out_dir, devices):
    if case.get("cpu_fp16"):
        allow_fp16_on_deepspeed_cpu()
    L.seed_everything(case.get("init_seed", 0), verbose=False)
    module = ManualModule(case) if case.get("manual") else Module(case)
    init = {n: p.detach().clone() for n, p in module.named_parameters()}
    callbacks = [PrivacyAccountantCallback(target_epsilon=case.get("target_epsilon"), delta=case.get("delta", 1e-5),
                                           on_budget_exhausted=case.get("on_budget_exhausted", "stop"),
                                           log_second_accountant=case.get("log_second_accountant", False))]
    if case.get("stop_at"):
        callbacks.append(StopAt(case["stop_at"]))
    if case.get("count_barriers"):
        rank = int(os.environ.get("RANK", "0"))
        callbacks.append(CountBarriers(os.path.join(out_dir, f"{case['name']}.barriers{rank}.json")))
    if case.get("count_gathered"):
        callbacks.append(PeakGathered())
    if case.get("record_steps"):  # the whole parameters after every optimizer step (gathered on ZeRO-3)
        callbacks.append(EveryStep(case["stage"]))
    strategy = DPDeepSpeedStrategy(
        stage=case["stage"], noise_multiplier=case["sigma"], max_grad_norm=float(case["C"]),
        clipping=case["clipping"], clipping_fn=case["clipping_fn"], poisson_sampling=case["poisson"],
        clipping_groups=case.get("clipping_groups"), clipping_mode=case.get("clipping_mode", "book-keeping"),
        seed=case.get("seed", 1234), secure_mode=case.get("secure_mode", False),
        max_micro_batch_size=case.get("max_micro_batch_size"), **case.get("strategy_kwargs", {}))
    strategy.config.setdefault("zero_optimization", {}).update(case.get("zero_config", {}))
    trainer = L.Trainer(
        strategy=strategy, accelerator=case.get("accelerator", "cpu"), devices=devices // case.get("num_nodes", 1),
        num_nodes=case.get("num_nodes", 1), max_steps=case["steps"],
        max_epochs=case.get("max_epochs"),  # -1 with steps=-1: unbounded (the privacy budget stops it)
        limit_train_batches=case.get("limit_train_batches"),
        accumulate_grad_batches=case["accumulate"], precision=case.get("precision", "32-true"),
        use_distributed_sampler=case.get("use_distributed_sampler", True),
        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, ckpt_path=case.get("resume_from"))
    if case.get("save_path"):
        trainer.save_checkpoint(case["save_path"])
    final = gathered_params(module, case["stage"])
    rank = trainer.global_rank
    name = case["name"]
    with open(os.path.join(out_dir, f"{name}.seen{rank}.json"), "w") as f:
        json.dump(module.seen, f)
    torch.save(final, os.path.join(out_dir, f"{name}.final{rank}.pt"))
    if case.get("record_metrics"):  # every rank: the logged DP metrics, to compare across ranks
        with open(os.path.join(out_dir, f"{name}.metrics{rank}.json"), "w") as f:
            json.dump({k: float(v) for k, v in trainer.callback_metrics.items()}, f)
    if case.get("record_ranks"):  # every rank: what it used (layout, sampler, plan, noise scales, ledger)
        sampler = trainer.train_dataloader.batch_sampler
        with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as f:
            json.dump({"cluster_environment": type(strategy.cluster_environment).__name__,
                       "global_rank": rank, "local_rank": trainer.local_rank, "node_rank": trainer.node_rank,
                       "world_size": trainer.world_size, "num_nodes": trainer.num_nodes,
                       "num_devices": trainer.num_devices, "sampler_rank": sampler.rank,
                       "sampler_replicas": sampler.num_replicas, "sampler_examples": len(sampler.shard),
                       "sample_rate": sampler.sample_rate, "plan": vars(strategy.plan),
                       "noise_scales": list(strategy.mechanism.noise_scales()), "ledger": strategy.ledger.to_dict(),
                       "epsilon": float(callbacks[0].epsilon())}, f)
    if rank == 0:
        torch.save({"init": init, "final": final, "ledger": strategy.ledger.to_dict(),
                    "global_step": trainer.global_step, "plan": vars(strategy.plan),
                    "deepspeed_global_steps": int(strategy.deepspeed_engine.global_steps),
                    "deepspeed_skipped_steps": int(getattr(strategy.deepspeed_engine, "skipped_steps", 0)),
                    "zero3_whole_params": sum(bool(getattr(p, "ds_persist", False)) for p in module.parameters()),
                    "peak_gathered_in_backward": next((c.peak for c in callbacks if isinstance(c, PeakGathered)), None),
                    "steps": next((c.params for c in callbacks if isinstance(c, EveryStep)), None),
                    "param_numel": sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters()),
                    "epsilon": float(callbacks[0].epsilon()),
                    "train_loss_epoch": float(trainer.callback_metrics.get("train_loss_epoch", float("nan")))},
                   os.path.join(out_dir, f"{name}.pt"))


def main(run=None):
    """Run every case of the JSON list ``argv[1]`` with ``run`` (default :func:`run_case`), writing to ``argv[2]``."""
    cases = json.load(open(sys.argv[1]))
    out_dir = sys.argv[2]
    devices = int(os.environ.get("WORLD_SIZE", "1"))
    for case in cases:
        (run or run_case)(case, out_dir, devices)
        torch.distributed.barrier() if torch.distributed.is_initialized() else None
    # every case is written on every rank (the barrier): the harness tells a rank that gloo aborts while the
    # processes exit apart from one that failed
    Path(out_dir, f"done{os.environ.get('RANK', '0')}").touch()


if __name__ == "__main__":
    main()
