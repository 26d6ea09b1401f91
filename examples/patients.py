"""User-level DP on synthetic "patients with notes": ε protects a patient, whatever the number of their notes.

    python examples/patients.py                        # user-level DP at epsilon <= 4 per patient
    python examples/patients.py --example-level        # the same run, example-level (ε per note)

Data (synthetic, generated here): 600 patients with 1 to 12 notes each (about 3,900 notes). Each patient has a
diagnosis (one of 4) and a latent profile; each note is a 32-dimensional embedding of that profile plus noise
(as a sentence encoder would give). The task: the diagnosis from one note. 150 further patients are the test set.

With ``privacy_unit="user"`` every patient is sampled with probability q = batch_size / 600 per step and contributes
at most ``max_examples_per_user`` notes (k, default 4), whose mean gradient is clipped as one: the (ε, δ) the run
prints bounds what the model reveals about any one patient, all their notes together. Example-level DP at the same
ε protects one note; a patient with 12 notes is then protected only at about 12·ε (group privacy).

The last line is ``accuracy=A epsilon=E delta=D unit=user``: test accuracy, ε spent (from the privacy ledger) and δ.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator, without its "unable to detect a GPU" notice
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import lightning as L
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_dpzero  # noqa: F401  (registers the dp_deepspeed* strategies)
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback

try:
    from .digits import quiet
except ImportError:  # run as a script: python examples/patients.py
    from digits import quiet

DIM, CLASSES = 32, 4


class PatientNotes(Dataset):
    """Notes as (embedding (32,), diagnosis); ``user_ids[i]`` is note i's patient (what user-level DP reads)."""

    def __init__(self, patients: int, seed: int, first_id: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(99))  # shared by both splits
        diagnosis = torch.randint(0, CLASSES, (patients,), generator=g)
        profile = centres[diagnosis] + 1.5 * torch.randn(patients, DIM, generator=g)
        counts = torch.randint(1, 13, (patients,), generator=g)
        owner = torch.repeat_interleave(torch.arange(patients), counts)
        self.x = profile[owner] + 2.0 * torch.randn(len(owner), DIM, generator=g)
        self.y = diagnosis[owner]
        self.user_ids = [f"patient-{first_id + int(p)}" for p in owner]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class NoteClassifier(L.LightningModule):
    """Linear(32→64) → LayerNorm → Tanh → Linear(64→4), SGD; accuracy on the held-out patients' notes."""

    def __init__(self, lr: float = 2.0) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(DIM, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, CLASSES))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)  # the mean over the micro-batch's notes

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    @torch.no_grad()
    def accuracy(self, data: PatientNotes) -> float:
        return float((self.net(data.x).argmax(-1) == data.y).float().mean())


def main(argv=None) -> tuple[float, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--example-level", action="store_true", help="privacy_unit='example' (ε per note)")
    p.add_argument("--max-examples-per-user", type=int, default=4, help="k: notes per sampled patient")
    p.add_argument("--target-epsilon", type=float, default=4.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=60, help="patients (or notes) per step, expected")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quiet()
    train, test = PatientNotes(600, seed=1), PatientNotes(150, seed=2, first_id=600)
    unit = "example" if args.example_level else "user"
    strategy = DPDeepSpeedStrategy(
        stage=2, max_grad_norm=1.0, clipping="all-layer", privacy_unit=unit,
        max_examples_per_user=None if args.example_level else args.max_examples_per_user,
        logging_level=logging.ERROR)
    accountant = PrivacyAccountantCallback(target_epsilon=args.target_epsilon, delta=args.delta)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=args.epochs,
                        callbacks=[accountant], logger=False, enable_checkpointing=False,
                        enable_model_summary=False, enable_progress_bar=False)
    L.seed_everything(args.seed, verbose=False)
    model = NoteClassifier()
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size))
    accuracy, epsilon = model.accuracy(test), accountant.epsilon()
    print(f"accuracy={accuracy:.3f} epsilon={epsilon:.2f} delta={args.delta:g} unit={unit}", flush=True)
    return accuracy, epsilon


if __name__ == "__main__":
    main()
