"""The strategy's CPU support: fit, then validate/test (DeepSpeed's inference engine) in one process."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dpzero.strategy as strategy_mod
from lightning_dpzero import DPDeepSpeedStrategy


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def training_step(self, batch, _):
        return nn.functional.cross_entropy(self.fc(batch[0]), batch[1])

    def validation_step(self, batch, _):
        self.log("val_loss", nn.functional.cross_entropy(self.fc(batch[0]), batch[1]))

    def test_step(self, batch, _):
        self.log("test_loss", nn.functional.cross_entropy(self.fc(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _loader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)),
                          batch_size=4)

    train_dataloader = val_dataloader = test_dataloader = _loader


def test_the_cuda_check_uses_the_trainers_accelerator_class():
    # The Trainer's accelerators come from lightning.pytorch; lightning_fabric's class of the same name is unrelated.
    from lightning.pytorch.accelerators import CUDAAccelerator

    assert strategy_mod.CUDAAccelerator is CUDAAccelerator


def test_validate_and_test_after_fit_on_cpu():
    trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), accelerator="cpu", devices=1,
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=2)
    model = Net()
    trainer.fit(model)
    assert trainer.validate(model, verbose=False)[0]["val_loss"] > 0
    assert trainer.test(model, verbose=False)[0]["test_loss"] > 0
