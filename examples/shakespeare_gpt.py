"""A small GPT-style character language model trained from scratch with DP-SGD on Tiny Shakespeare.

Run it from the repository root through the Lightning CLI (ZeRO-3, 2 CPU processes, ε = 8):

    lightning-dpzero fit --config examples/configs/shakespeare_gpt.yaml
    python examples/shakespeare_gpt.py                 # the same, with that config
    python examples/shakespeare_gpt.py --trainer.max_steps=3 --trainer.val_check_interval=3   # any override

Data: ``examples/data/tinyshakespeare.txt`` (public domain; see ``examples/data/README.md``), read as
bytes (ASCII, so one byte is one character; the vocabulary is the 256 byte values). The first 90% of the
text is the training set, the last 10% the validation set. Both are cut into disjoint windows of
``seq_len + 1`` bytes; one window (a sequence of ``seq_len`` next-character predictions) is one example,
the unit that differential privacy protects.

Model: token and position embeddings (``nn.Embedding``; positions are ``arange(T)`` expanded to (B, T),
batch first), ``n_layers`` pre-LayerNorm transformer blocks whose causal self-attention uses ``nn.Linear``
q/k/v/o projections and ``scaled_dot_product_attention``, a final LayerNorm and a linear head. Every
trainable layer is one the per-example engine supports (Linear, Embedding, LayerNorm).

Reported: validation perplexity (``torchmetrics.text.Perplexity``, synced over ranks) against the unigram
baseline (the perplexity of the training set's byte frequencies on the validation text, about 28.4), and ε.
The last line rank 0 prints is ``val_perplexity=P unigram_perplexity=U epsilon=E delta=D wall_time=Ts``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator, without its "unable to detect a GPU" notice
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import lightning as L
import torch.nn.functional as F
from torch import nn

try:
    from ._common import fit_from_config, privacy_spent
except ImportError:  # run as a script: python examples/<name>.py
    from _common import fit_from_config, privacy_spent
from torch.utils.data import DataLoader, Dataset, Subset
from torchmetrics.text import Perplexity

HERE = Path(__file__).resolve().parent
DEFAULT_TEXT = HERE / "data" / "tinyshakespeare.txt"
DEFAULT_CONFIG = HERE / "configs" / "shakespeare_gpt.yaml"
VOCAB_SIZE = 256  # bytes


# ---------------------------------------------------------------------------------------------- data
class Windows(Dataset):
    """Disjoint windows of ``seq_len + 1`` tokens: example i is (x, y) = (w[:-1], w[1:])."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        n = (len(tokens) - 1) // (seq_len + 1)
        self.windows = tokens[: n * (seq_len + 1)].view(n, seq_len + 1)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i):
        w = self.windows[i]
        return w[:-1], w[1:]


def read_bytes(path: Optional[str] = None) -> torch.Tensor:
    data = Path(path or DEFAULT_TEXT).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch_size(batch) -> int:
    """Examples in a batch (for ``ThroughputMonitor(batch_size_fn=...)``)."""
    return int(batch[0].shape[0])


def tokens(batch) -> int:
    """Predicted tokens in a batch (for ``ThroughputMonitor(length_fn=...)``: tokens/s)."""
    return int(batch[0].numel())


class TinyShakespeare(L.LightningDataModule):
    """Tiny Shakespeare as byte sequences; 90% / 10% contiguous train / validation split.

    Args:
        path: the text file (default: the copy shipped in ``examples/data``).
        seq_len: T, tokens per example.
        batch_size: per-device micro-batch; with DP the expected logical batch is batch_size × devices.
        val_batch_size: per-device validation batch.
        val_fraction: the last fraction of the text held out for validation.
        max_train_examples: use only the first this many training windows (None: all).
    """

    def __init__(self, path: Optional[str] = None, seq_len: int = 64, batch_size: int = 128,
                 val_batch_size: int = 256, val_fraction: float = 0.1,
                 max_train_examples: Optional[int] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: Optional[Windows] = None
        self.val_set: Optional[Windows] = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        data = read_bytes(self.hparams.path)
        split = int(len(data) * (1 - self.hparams.val_fraction))
        self.train_tokens, self.val_tokens = data[:split], data[split:]
        self.train_set = Windows(self.train_tokens, self.hparams.seq_len)
        if self.hparams.max_train_examples is not None:
            self.train_set.windows = self.train_set.windows[: self.hparams.max_train_examples]
        self.val_set = Windows(self.val_tokens, self.hparams.seq_len)

    def unigram_perplexity(self) -> float:
        """Perplexity on the validation windows' targets of the training bytes' frequencies (add-one)."""
        counts = torch.bincount(self.train_tokens, minlength=VOCAB_SIZE).double() + 1
        logp = (counts / counts.sum()).log()
        targets = self.val_set.windows[:, 1:].reshape(-1)
        return math.exp(-float(logp[targets].mean()))

    def train_dataloader(self):
        # batch_size is the per-device micro-batch; DPDeepSpeedStrategy replaces the sampler with a
        # distributed Poisson sampler at q = batch_size × devices / N.
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        # Each rank scores a disjoint share, so the synced perplexity covers every window exactly once.
        world = self.trainer.world_size if self.trainer is not None else 1
        rank = self.trainer.global_rank if self.trainer is not None else 0
        share = Subset(self.val_set, list(range(rank, len(self.val_set), world)))
        return DataLoader(share, batch_size=self.hparams.val_batch_size)


# ---------------------------------------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with ``nn.Linear`` q/k/v/o projections on (B, T, d) inputs."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not a multiple of n_heads={n_heads}.")
        self.n_heads = n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        h = self.n_heads

        def heads(t):  # (B, T, d) -> (B, h, T, d/h)
            return t.view(B, T, h, d // h).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d_model), CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(L.LightningModule):
    """GPT-style character LM. ``training_step`` returns the mean next-character loss over the batch.

    Args:
        seq_len: T (must equal the datamodule's).
        d_model, n_layers, n_heads: width, depth and attention heads.
        lr, betas, weight_decay: Adam(W) settings (DP-Adam: the noise is added before Adam sees the gradient).
        warmup_steps: linear learning-rate warm-up.
    """

    def __init__(self, seq_len: int = 64, d_model: int = 128, n_layers: int = 2, n_heads: int = 4,
                 lr: float = 3e-3, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 warmup_steps: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, n_heads) for _ in range(n_layers)))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE)
        self.val_ppl = Perplexity()
        self._t0: Optional[float] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape
        positions = torch.arange(T, device=x.device).expand(B, T)  # batch first, as every layer's input must be
        h = self.blocks(self.tok(x) + self.pos(positions))
        return self.head(self.ln_f(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1))  # mean over examples and tokens
        self.log("train_loss", loss, on_step=True, on_epoch=False, batch_size=len(x))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_ppl.update(logits.float(), y)
        self.log("val_perplexity", self.val_ppl, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(x))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, betas=tuple(self.hparams.betas),
                                weight_decay=self.hparams.weight_decay)
        if not self.hparams.warmup_steps:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: min(1.0, (step + 1) / self.hparams.warmup_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_fit_start(self) -> None:
        dm = self.trainer.datamodule
        if dm is not None and getattr(dm.hparams, "seq_len", self.hparams.seq_len) != self.hparams.seq_len:
            raise ValueError(f"model seq_len={self.hparams.seq_len} but data seq_len={dm.hparams.seq_len}; "
                             "set both to the same value.")
        self._t0 = time.perf_counter()

    def on_fit_end(self) -> None:
        # One summary line from rank 0 (the CLI run's result; tests parse it).
        trainer = self.trainer
        ppl = trainer.callback_metrics.get("val_perplexity")
        eps, delta = privacy_spent(trainer)
        dm = trainer.datamodule
        unigram = dm.unigram_perplexity() if dm is not None and hasattr(dm, "unigram_perplexity") else float("nan")
        wall = time.perf_counter() - (self._t0 or time.perf_counter())
        if trainer.is_global_zero:
            ppl_s = f"{float(ppl):.3f}" if ppl is not None else "nan"
            print(f"val_perplexity={ppl_s} unigram_perplexity={unigram:.3f} epsilon={eps:.3f} delta={delta:g} "
                  f"wall_time={wall:.1f}s", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    """``python examples/shakespeare_gpt.py [LightningCLI overrides]``: fit with the default config."""
    args = sys.argv[1:] if argv is None else list(argv)
    return fit_from_config(DEFAULT_CONFIG, args)


if __name__ == "__main__":
    sys.exit(main())
