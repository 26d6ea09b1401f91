"""``lightning_dpzero.fix_model``: the fix the BatchNorm refusal names (issue #45, item 5): every BatchNorm becomes
a GroupNorm with the same affine parameters (G = gcd(32, C) as Opacus' ``ModuleValidator.fix``; 1 for
BatchNorm1d), an InstanceNorm with running statistics loses them, and the fixed model trains under DP."""

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dpzero  # noqa: F401
from lightning_dpzero import DPDeepSpeedStrategy, UnsupportedLayerError, fix_model


class ConvNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
                                  nn.Flatten(), nn.Linear(12 * 16, 2))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(model):
    data = TensorDataset(torch.randn(32, 1, 4, 4), torch.randint(0, 2, (32,)))
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return strategy


def test_a_batchnorm_model_is_refused_naming_fix_model_and_trains_once_fixed():
    model = ConvNet()
    with torch.no_grad():
        model.body[1].weight.uniform_(0.5, 1.5)
        model.body[1].bias.uniform_(-1, 1)
    weight, bias = model.body[1].weight.detach().clone(), model.body[1].bias.detach().clone()
    with pytest.raises(UnsupportedLayerError, match=r"BatchNorm2d 'body\.1'.*lightning_dpzero\.fix_model\(model\)"):
        _fit(model)
    assert fix_model(model) is model
    norm = model.body[1]
    assert type(norm) is nn.GroupNorm and (norm.num_groups, norm.num_channels) == (4, 12)  # gcd(32, 12)
    assert torch.equal(norm.weight, weight) and torch.equal(norm.bias, bias)
    assert _fit(model).ledger.steps == 2


def test_every_batchnorm_kind_and_running_statistics_are_replaced():
    bn1, bn3 = nn.BatchNorm1d(6, affine=False), nn.BatchNorm3d(64, eps=1e-3)
    frozen = nn.BatchNorm2d(20)
    frozen.requires_grad_(False)
    model = nn.ModuleDict({"bn1": bn1, "bn3": bn3, "frozen": frozen, "sync": nn.SyncBatchNorm(40),
                           "inorm": nn.InstanceNorm2d(5, affine=True, track_running_stats=True),
                           "plain_inorm": nn.InstanceNorm1d(5), "shared": nn.Sequential(bn3), "lin": nn.Linear(3, 3)})
    lin, plain = model["lin"], model["plain_inorm"]
    fix_model(model)
    assert (model["bn1"].num_groups, model["bn1"].affine) == (1, False)  # (N, C) inputs: one group, not one each
    assert (model["bn3"].num_groups, model["bn3"].eps) == (32, 1e-3)
    assert model["shared"][0] is model["bn3"]  # a layer shared by two parents stays shared
    assert model["frozen"].num_groups == 4 and not model["frozen"].weight.requires_grad
    assert type(model["sync"]) is nn.GroupNorm and model["sync"].num_groups == 8
    assert type(model["inorm"]) is nn.InstanceNorm2d and not model["inorm"].track_running_stats
    assert model["inorm"].affine and model["lin"] is lin and model["plain_inorm"] is plain
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    from lightning_dpzero.per_sample.coverage import check_batch_mixing

    check_batch_mixing(model)  # nothing left to refuse
    assert type(fix_model(nn.BatchNorm2d(3))) is nn.GroupNorm  # the layer itself: its replacement is returned


def test_the_replacement_keeps_device_dtype_and_mode_and_a_lazy_layer_is_refused():
    bn = nn.BatchNorm2d(8).to(torch.float64).eval()
    new = fix_model(bn)
    assert new.weight.dtype == torch.float64 and not new.training
    with pytest.raises(ValueError, match="has not seen an input yet"):
        fix_model(nn.Sequential(nn.LazyBatchNorm2d()))
