"""The strategy's CPU support: fit, then validate/test (DeepSpeed's inference engine) in one process."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dpzero.deepspeed.launch as launch_mod
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

    assert launch_mod.CUDAAccelerator is CUDAAccelerator


def test_validate_and_test_after_fit_on_cpu():
    trainer = L.Trainer(strategy=DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), accelerator="cpu", devices=1,
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=2)
    model = Net()
    trainer.fit(model)
    assert trainer.validate(model, verbose=False)[0]["val_loss"] > 0
    assert trainer.test(model, verbose=False)[0]["test_loss"] > 0


def _launched(monkeypatch, **env):
    from lightning.fabric.plugins.environments import LightningEnvironment

    for k in ("NODE_RANK", "GROUP_RANK", "CROSS_RANK", "RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = DPDeepSpeedStrategy(noise_multiplier=1.0, cluster_environment=LightningEnvironment(),
                            parallel_devices=[torch.device("cpu")])
    s.num_nodes = 2
    return s


def test_deepspeed_launchers_cross_rank_gives_the_node_rank(monkeypatch):
    # `deepspeed --hostfile` sets CROSS_RANK (the node) but not NODE_RANK: without the mapping both nodes'
    # processes become global rank 0 and the run hangs.
    s = _launched(monkeypatch, CROSS_RANK="1", LOCAL_RANK="0", RANK="1", WORLD_SIZE="2")
    s.set_world_ranks()
    assert (s.node_rank, s.global_rank, s.world_size) == (1, 1, 2)


def test_a_rank_the_launcher_and_lightning_disagree_on_is_refused(monkeypatch):
    import pytest

    s = _launched(monkeypatch, NODE_RANK="0", LOCAL_RANK="0", RANK="1", WORLD_SIZE="2")  # RANK says node 1
    with pytest.raises(ValueError, match=r"RANK=1.*global rank 0.*num_nodes"):
        s.set_world_ranks()
