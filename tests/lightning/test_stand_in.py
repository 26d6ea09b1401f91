"""An empty Poisson micro-batch's one-row stand-in in a Trainer run: prepared as Lightning prepares a batch (the
precision's input conversion, ``on_before_batch_transfer``), drawing nothing from the random streams a later step
sees, its outputs without rows, and flagged by ``trainer.strategy.stand_in_batch``. That it adds nothing to the
update is checked against the per-example replay in tests/per_sample/test_zoo.py and tests/lightning/test_invariants.py."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_dpzero  # noqa: F401  (registers the strategies)
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback

N = 12


class Raw(Dataset):
    """Examples as the user's loader gives them: a dict the batch hook turns into a tuple."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"features": torch.randn(6, generator=g), "label": i % 3, "index": i}


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 3))
        self.steps = []  # (stand-in?, random state unchanged by the step?, rows of the outputs' preds)

    def on_before_batch_transfer(self, batch, dataloader_idx):  # the collate's dict -> the step's tuple
        return batch["features"], torch.tensor(batch["label"]), torch.tensor(batch["index"])

    def on_train_batch_start(self, batch, batch_idx):
        self._state = torch.get_rng_state()

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        out = self.net(x)  # bf16-mixed: x was converted as Lightning converts a batch
        return {"loss": nn.functional.cross_entropy(out, y), "preds": out.argmax(1)}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.steps.append((self.trainer.strategy.stand_in_batch, torch.equal(self._state, torch.get_rng_state()),
                           len(outputs["preds"])))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_empty_micro_batch_runs_on_a_prepared_stand_in_that_leaves_no_trace():
    L.seed_everything(0, verbose=False)
    model = Module()
    trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=0.0, max_grad_norm=1.0, seed=7),
                        accelerator="cpu", devices=1, max_steps=10, precision="bf16-mixed",
                        callbacks=[PrivacyAccountantCallback(delta=1e-5)], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(Raw(), batch_size=1, shuffle=True, collate_fn=lambda b: {
        "features": torch.stack([e["features"] for e in b]) if b else torch.zeros(0, 6),
        "label": [e["label"] for e in b], "index": [e["index"] for e in b]}))
    stand_ins = [s for s in model.steps if s[0]]
    assert stand_ins and len(stand_ins) < len(model.steps), model.steps  # q·N = 1: some empty, some not
    assert all(unchanged and rows == 0 for _, unchanged, rows in stand_ins), model.steps
    assert not all(unchanged for stand_in, unchanged, _ in model.steps if not stand_in)  # dropout draws
