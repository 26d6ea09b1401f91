"""Differentially private CNN on scikit-learn's handwritten digits in a Lightning Fabric loop, on DeepSpeed
ZeRO-3 (CPU, 2 processes): the model, data and settings of ``examples/digits.py``, your own training loop.

    python examples/fabric_digits.py                   # DP-SGD at epsilon <= 8, delta = 1e-5
    python examples/fabric_digits.py --stage 2 --epochs 10
    python examples/fabric_digits.py --checkpoint ckpt/  # fabric.save at the end (the ledger goes with it)

The last line printed (by rank 0 only) is ``accuracy=A epsilon=E delta=D``: test accuracy of the DP model, the
epsilon actually spent (exact, from the privacy ledger) and delta.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator, without its "unable to detect a GPU" notice
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, Subset

import lightning_dpzero  # noqa: F401  (registers the dp_deepspeed* strategies with Fabric too)
from lightning_dpzero import DPFabricStrategy

try:
    from .digits import DigitsCNN, add_dp_arguments, digits_datasets, quiet
except ImportError:  # run as a script: python examples/fabric_digits.py
    from digits import DigitsCNN, add_dp_arguments, digits_datasets, quiet


def train(args: argparse.Namespace) -> None:
    strategy = DPFabricStrategy(
        stage=args.stage, max_grad_norm=args.max_grad_norm, noise_multiplier=args.noise_multiplier,
        target_epsilon=None if args.noise_multiplier is not None else args.target_epsilon, delta=args.delta,
        max_epochs=args.epochs, seed=args.noise_seed, noise_mechanism=args.noise_mechanism, bands=args.bands,
        logging_level=logging.ERROR)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(args.seed)  # the same initial weights on every rank
    train_set, test_set = digits_datasets()
    model = DigitsCNN().net  # Conv + GroupNorm + Linear: no BatchNorm, whose statistics mix examples
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    # batch_size is the per-device micro-batch: the strategy replaces the sampler by a Poisson sampler with
    # q = batch_size x devices / N, the expected logical batch of one optimizer step
    train_loader = fabric.setup_dataloaders(DataLoader(train_set, batch_size=args.batch_size, shuffle=True))

    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:  # one Poisson-sampled batch per optimizer step
            loss = nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()  # clipped per example, noised, charged to the privacy ledger
            optimizer.zero_grad()
            fabric.log_dict(fabric.strategy.privacy_metrics)  # epsilon, delta, sigma, q, clip fraction, ...
            if fabric.strategy.should_stop:  # one more step would exceed target_epsilon
                break
        fabric.print(f"epoch {epoch}: epsilon={fabric.strategy.privacy_metrics['epsilon']:.2f}")
        if fabric.strategy.should_stop:
            break

    # each rank scores its own share of the 297 test images; the sums are reduced over the ranks
    model.eval()
    share = Subset(test_set, list(range(fabric.global_rank, len(test_set), fabric.world_size)))
    correct = total = 0
    with torch.no_grad():
        for x, y in DataLoader(share, batch_size=512):
            correct += int((model(x).argmax(-1) == y).sum())
            total += len(y)
    counts = fabric.all_reduce(torch.tensor([correct, total], dtype=torch.float64), reduce_op="sum")
    if args.checkpoint:
        fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "epoch": epoch})
    plan = fabric.strategy.plan
    fabric.print(f"DP-SGD (Fabric): ZeRO-{args.stage}, {fabric.world_size} processes, sigma={plan.noise_multiplier:.4f}, "
                 f"C={args.max_grad_norm}, {fabric.strategy.ledger.steps} steps, {time.perf_counter() - start:.1f} s")
    fabric.print(f"accuracy={float(counts[0] / counts[1]):.2f} epsilon={fabric.strategy.epsilon():.2f} "
                 f"delta={args.delta:g}")


def parse_args(argv=None) -> argparse.Namespace:
    p = add_dp_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    p.add_argument("--checkpoint", default=None, help="directory for fabric.save at the end")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.devices)))
    quiet()
    train(args)


if __name__ == "__main__":
    sys.exit(main())
