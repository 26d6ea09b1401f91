"""Differentially private CNN on scikit-learn's handwritten digits, on DeepSpeed ZeRO-3 (CPU, 2 processes).

    python examples/digits.py                      # DP-SGD at epsilon <= 8, delta = 1e-5
    python examples/digits.py --compare            # also train the same model without DP (one process)
    python examples/digits.py --noise-multiplier 1.2 --epochs 10   # explicit sigma, no target epsilon
    lightning-dpzero ledger show checkpoints/digits.ckpt            # the privacy ledger of the checkpoint it saved

Data: ``sklearn.datasets.load_digits`` (1,797 real 8x8 grey-scale images, 10 classes), split once with a
fixed seed into 1,500 training and 297 test images. Model: Conv2d + GroupNorm + Linear (no BatchNorm, whose
batch statistics mix examples and so cannot be clipped per example).

Rank 0 prints a line per epoch (``epoch 3/20: epsilon=3.18 (18 steps, 2 s)``), saves a checkpoint (ZeRO shards
and the privacy ledger) to ``checkpoints/digits.ckpt`` (``--checkpoint``), and its last line is
``accuracy=A epsilon=E delta=D``: test accuracy of the DP model, the epsilon actually spent (exact, from the
privacy ledger) and delta. From YAML
(``lightning-dpzero fit --config examples/configs/digits.yaml``) ``DigitsCNN(print_summary=True)`` prints the
same line at the end of fit.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

import torch

if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator, without its "unable to detect a GPU" notice
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import lightning as L
import torchmetrics
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import lightning_dpzero  # noqa: F401  (registers the dp_deepspeed* strategies)
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback

try:
    from ._common import privacy_spent
except ImportError:  # run as a script: python examples/digits.py
    from _common import privacy_spent

N_TRAIN = 1500
SPLIT_SEED = 0


def digits_datasets() -> tuple[TensorDataset, TensorDataset]:
    """1,500 / 297 train/test split of the 1,797 digits, the same on every rank and every run."""
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0  # pixel values are 0..16
    x = (x - 0.5) / 0.5
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    train, test = order[:N_TRAIN], order[N_TRAIN:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class DigitsCNN(L.LightningModule):
    """Conv(1→16) → GroupNorm → ReLU → Conv(16→32, stride 2) → GroupNorm → ReLU → Linear(512→10).

    ``print_summary=True`` (set by ``examples/configs/digits.yaml``): rank 0 prints
    ``accuracy=A epsilon=E delta=D`` at the end of fit, as ``python examples/digits.py`` does.
    """

    def __init__(self, lr: float = 1.0, batch_size: int = 64, momentum: float = 0.0,
                 print_summary: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(4, 32), nn.ReLU(),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
        )
        self.train_set, self.test_set = digits_datasets()
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)  # the mean over the batch, as usual

    def validation_step(self, batch, batch_idx):
        # The held-out 297 images. Scored inside fit (at the end of the last epoch): after fit, DPDeepSpeedStrategy
        # cannot yet run trainer.test/validate on the CPU (DeepSpeed's inference init gets device_rank=None).
        x, y = batch
        self.test_acc(self(x).argmax(-1), y)
        self.log("test_acc", self.test_acc, on_step=False, on_epoch=True, batch_size=len(y), prog_bar=True)

    def on_fit_end(self) -> None:
        if not self.hparams.print_summary:
            return
        acc = self.trainer.callback_metrics.get("test_acc")  # synced over ranks by torchmetrics
        eps, delta = privacy_spent(self.trainer)
        if self.trainer.is_global_zero:
            acc_s = f"{float(acc):.2f}" if acc is not None else "nan"  # nan: the test split was never scored
            print(f"accuracy={acc_s} epsilon={eps:.2f} delta={delta:g}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)

    def train_dataloader(self):
        # batch_size is the per-device micro-batch: with DP the strategy replaces the sampler by a Poisson
        # sampler with q = batch_size x devices / N (expected logical batch batch_size x devices).
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        # Each rank scores its own disjoint share, so the synced accuracy covers all 297 images exactly once
        # (Lightning's DistributedSampler would pad the odd-sized test set with a repeated image).
        world, rank = self.trainer.world_size, self.trainer.global_rank
        indices = list(range(rank, len(self.test_set), world))
        return DataLoader(Subset(self.test_set, indices), batch_size=512)


class EpochLine(L.Callback):
    """Rank 0 prints one line per training epoch, ``epoch 3/20: epsilon=3.18 (18 steps, 2 s)``: ε spent so far
    (exact, from the privacy ledger), the optimizer steps and the seconds since training started, so that a run
    shows its progress without a progress bar."""

    def __init__(self, accountant: PrivacyAccountantCallback) -> None:
        self.accountant, self.start = accountant, time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            print(f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}: epsilon={self.accountant.epsilon():.2f} "
                  f"({trainer.global_step} steps, {time.perf_counter() - self.start:.0f} s)", flush=True)


def quiet() -> None:
    """Keep stdout readable: Lightning's info banners and DeepSpeed's per-step logs off; errors stay."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning", "lightning",
                 "DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.ERROR)
    except ImportError:
        pass
    for pattern in (".*does not have many workers.*", ".*Total length of .* across ranks is zero.*",
                    ".*The number of training batches .* is smaller than the logging interval.*",
                    ".*`isinstance\\(treespec, LeafSpec\\)` is deprecated.*", ".*srun.*", ".*torch.distributed.*",
                    ".*It is recommended to use .*sync_dist=True.*"):
        warnings.filterwarnings("ignore", message=pattern)


def train_dp(args: argparse.Namespace) -> tuple[float, float, float, float, bool]:
    """DP-SGD on ZeRO, then the checkpoint ``args.checkpoint`` (unless empty); returns (test accuracy, epsilon,
    delta, sigma, is rank 0)."""
    strategy = DPDeepSpeedStrategy(
        stage=args.stage, noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm,
        clipping=args.clipping, clipping_fn=args.clipping_fn, seed=args.noise_seed,
        noise_mechanism=args.noise_mechanism, bands=args.bands, logging_level=logging.ERROR)
    target = None if args.noise_multiplier is not None else args.target_epsilon
    accountant = PrivacyAccountantCallback(target_epsilon=target, delta=args.delta)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=args.devices, max_epochs=args.epochs,
        callbacks=[accountant, EpochLine(accountant)], logger=False, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        check_val_every_n_epoch=args.epochs)  # score the test split once, after the last epoch
    L.seed_everything(args.seed, verbose=False)  # same initial weights on every rank
    model = DigitsCNN(lr=args.lr, batch_size=args.batch_size, momentum=args.momentum)
    trainer.fit(model)
    if args.checkpoint:  # every rank writes its ZeRO shards; the privacy ledger goes beside them
        trainer.save_checkpoint(args.checkpoint)
    accuracy = float(trainer.callback_metrics["test_acc"])  # synced over ranks by torchmetrics
    return accuracy, accountant.epsilon(), accountant.delta, strategy.plan.noise_multiplier, trainer.is_global_zero


def train_plain(args: argparse.Namespace) -> float:
    """The same model and data without DP: one process, Lightning's default strategy, Adam."""
    L.seed_everything(args.seed, verbose=False)
    model = DigitsCNN(lr=1e-2, batch_size=64)
    model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=args.compare_epochs, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                        num_sanity_val_steps=0, check_val_every_n_epoch=args.compare_epochs)
    trainer.fit(model)
    return float(trainer.callback_metrics["test_acc"])


def add_dp_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The settings of a DP run on the digits (shared with examples/fabric_digits.py)."""
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=128, help="per-device micro-batch (expected)")
    p.add_argument("--lr", type=float, default=2.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="C, per-example clipping bound")
    p.add_argument("--target-epsilon", type=float, default=8.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--noise-multiplier", type=float, default=None,
                   help="explicit sigma; then no target epsilon is set (epsilon is still reported)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    p.add_argument("--noise-seed", type=int, default=None,
                   help="seed of the DP noise and sampling (reproducible runs; it warns why not in production); "
                        "default: drawn from OS entropy")
    p.add_argument("--noise-mechanism", default="dp-sgd", choices=["dp-sgd", "banded-mf", "blt"],
                   help="independent noise per step, noise correlated over --bands steps (banded-mf), or over the "
                        "whole run (blt)")
    p.add_argument("--bands", type=int, default=None, help="b, for --noise-mechanism banded-mf or blt: the cyclic "
                                                           "parts")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = add_dp_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--clipping", default="layer-wise", choices=["layer-wise", "all-layer"])
    p.add_argument("--clipping-fn", default="abadi", choices=["abadi", "automatic"])
    p.add_argument("--compare", action="store_true", help="also train without DP and print its accuracy")
    p.add_argument("--compare-epochs", type=int, default=10)
    p.add_argument("--checkpoint", default="checkpoints/digits.ckpt",
                   help="where to save the DP model's checkpoint with its privacy ledger ('' for none)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.devices)))
    quiet()
    # Lightning re-runs this script for ranks >= 1 with LOCAL_RANK set: only rank 0 runs the comparison,
    # and it does so before the DP run starts the other processes.
    is_launcher = os.environ.get("LOCAL_RANK", "0") == "0"
    plain_acc = None
    if args.compare and is_launcher:
        start = time.perf_counter()
        plain_acc = train_plain(args)
        print(f"non-private: accuracy={plain_acc:.4f} ({args.compare_epochs} epochs, Adam, "
              f"{time.perf_counter() - start:.1f} s)", flush=True)
    if is_launcher:
        target = "explicit sigma" if args.noise_multiplier is not None else f"target epsilon {args.target_epsilon:g}"
        print(f"DP-SGD on {args.devices} CPU processes, ZeRO-{args.stage}, {args.epochs} epochs, {target}: starting "
              "(a first run also compiles DeepSpeed's CPU communication op, up to 2 minutes)", flush=True)
    start = time.perf_counter()
    acc, epsilon, delta, sigma, rank_zero = train_dp(args)
    if rank_zero:
        print(f"DP-SGD: ZeRO-{args.stage}, {args.devices} processes, {args.epochs} epochs, sigma={sigma:.4f}, "
              f"C={args.max_grad_norm}, {args.clipping}/{args.clipping_fn}, "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        if args.checkpoint:
            print(f"checkpoint: {args.checkpoint} (its privacy ledger: lightning-dpzero ledger show "
                  f"{args.checkpoint})", flush=True)
        print(f"accuracy={acc:.2f} epsilon={epsilon:.2f} delta={delta:g}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
