"""DP-SGD on DeepSpeed ZeRO-3, 2 CPU processes: python quickstart.py"""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dpzero  # noqa: F401  (registers the dp_deepspeed* strategies)
from lightning_dpzero import PrivacyAccountantCallback


class Classifier(L.LightningModule):
    """A LightningModule as you would write it without DP."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        # the mean of the per-example losses, as usual
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        accuracy = (self.net(x).argmax(-1) == y).float().mean()
        self.log("val_acc", accuracy, sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


L.seed_everything(0)
x = torch.randn(2560, 16)            # 2,048 training and 512 held-out examples
y = (x[:, 0] + x[:, 1] > 0).long()   # a label the model can learn
train_set = TensorDataset(x[:2048], y[:2048])
val_set = TensorDataset(x[2048:], y[2048:])
# batch_size is per process: the expected logical batch is 64 x 2 = 128
train_loader = DataLoader(train_set, batch_size=64, shuffle=True)
val_loader = DataLoader(val_set, batch_size=256)

accountant = PrivacyAccountantCallback(target_epsilon=8, delta=1e-5)
trainer = L.Trainer(
    strategy="dp_deepspeed_stage_3",  # DP-SGD on ZeRO-3
    accelerator="cpu", devices=2,     # or accelerator="gpu"
    max_epochs=5,                     # sigma is calibrated for these steps
    callbacks=[accountant],
    logger=False, enable_checkpointing=False, enable_model_summary=False,
)
trainer.fit(Classifier(), train_loader, val_loader)
trainer.save_checkpoint("checkpoints/last.ckpt")  # ZeRO shards + privacy ledger

if trainer.is_global_zero:
    val_acc = trainer.callback_metrics.get("val_acc", float("nan"))
    sigma = trainer.strategy.noise_multiplier
    print(f"val_acc={val_acc:.2f} epsilon={accountant.epsilon():.2f} "
          f"delta={accountant.delta:g} noise_multiplier={sigma:.3f}")
