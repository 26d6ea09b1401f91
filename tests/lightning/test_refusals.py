"""Bad input is refused before the first step, naming the setting or module and the fix (docs/design.md, I5)."""

import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dpzero  # noqa: F401
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback, UnsupportedLayerError


class Net(L.LightningModule):
    def __init__(self, body=None):
        super().__init__()
        self.body = body or nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.steps_run = 0

    def training_step(self, batch, _):
        self.steps_run += 1
        x, y = batch
        return nn.functional.cross_entropy(self.body(x).flatten(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=4)


def _fit(model, strategy, callbacks=(), **trainer_kw):
    trainer_kw = {"logger": False, **trainer_kw}
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=list(callbacks), **trainer_kw)
    trainer.fit(model)
    return trainer


def test_batchnorm_is_refused_before_training():
    model = Net(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))
    with pytest.raises(UnsupportedLayerError, match=r"BatchNorm1d 'body\.1'.*GroupNorm"):
        _fit(model, DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0))
    assert model.steps_run == 0


def test_gradient_clip_val_is_refused():
    with pytest.raises(ValueError, match="gradient_clip_val.*max_grad_norm"):
        _fit(Net(), DPDeepSpeedStrategy(stage=1, noise_multiplier=1.0), gradient_clip_val=1.0)


def test_manual_optimization_trains_and_what_it_still_refuses_before_training_is_named():
    """Manual optimization trains (tests/lightning/test_manual_optimization.py: each manual_backward + opt.step() one DP
    step); refused before training: only accumulation across batches (Lightning refuses it too)."""
    from types import SimpleNamespace

    from lightning_dpzero.lightning.manual_loop import manual_optimization_refusal

    class Manual(Net):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, _):
            self.steps_run += 1
            self.manual_backward(super().training_step(batch, _))
            self.optimizers().step()

    model = Manual()
    trainer = _fit(model, DPDeepSpeedStrategy(stage=0, noise_multiplier=1.0))
    assert trainer.global_step == trainer.strategy.ledger.steps == 2
    assert manual_optimization_refusal(SimpleNamespace(accumulate_grad_batches=1)) is None
    assert "accumulate_grad_batches=2" in manual_optimization_refusal(SimpleNamespace(accumulate_grad_batches=2))


def test_group_thresholds_above_max_grad_norm_are_refused():
    with pytest.raises(ValueError, match=r"sqrt\(sum C_k\^2\) = 14.14.*max_grad_norm = 1"):  # at construction
        DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0, max_grad_norm=1.0, clipping="group-wise",
                            clipping_groups=[["body.0.*"], ["body.2.*"]], group_max_grad_norms=[10, 10])


def test_deepspeed_config_gradient_clipping_is_refused():
    cfg = {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 4}
    with pytest.raises(ValueError, match="gradient_clipping"):
        _fit(Net(), DPDeepSpeedStrategy(config=cfg, noise_multiplier=1.0))


def test_missing_noise_multiplier_is_refused():
    model = Net()
    with pytest.raises(ValueError, match="noise_multiplier.*target_epsilon"):
        _fit(model, DPDeepSpeedStrategy(stage=2))
    assert model.steps_run == 0


def test_sigma_contradicting_the_target_is_refused():
    with pytest.raises(ValueError, match="target_epsilon"):
        _fit(Net(), DPDeepSpeedStrategy(stage=2, noise_multiplier=0.3),
             callbacks=[PrivacyAccountantCallback(target_epsilon=1.0)])


def test_target_epsilon_calibrates_sigma_and_logs():
    cb = PrivacyAccountantCallback(target_epsilon=2.0, delta=1e-5)
    strategy = DPDeepSpeedStrategy(stage=2)
    trainer = _fit(Net(), strategy, callbacks=[cb])
    assert strategy.noise_multiplier > 0
    assert trainer.callback_metrics["epsilon"] <= 2.0
    assert cb.epsilon() == pytest.approx(2.0, rel=0.011)
    assert strategy.ledger.steps == trainer.global_step == 2
    assert {"delta", "noise_multiplier", "sample_rate", "dp_steps"} <= set(trainer.callback_metrics)


@pytest.mark.parametrize("kwargs, match", [
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(clipping="flat"), "clipping"),
    (dict(clipping_fn="clamp"), "clipping_fn"),
    (dict(noise_multiplier=1.0, max_grad_norm=math.inf), "infinite noise"),
    (dict(clipping="all-layer", clipping_mode="ghost"), r"clipping_mode='ghost'.*'book-keeping', 'two-pass'"),
    (dict(clipping_mode="two-pass"), r"two-pass.*all-layer.*group-wise.*Leave clipping_mode at 'book-keeping'"),
])
def test_bad_strategy_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPDeepSpeedStrategy(stage=2, **kwargs)


def test_two_pass_clipping_refuses_fp16_before_the_first_update():
    # DeepSpeed's CPU accelerator refuses fp16, so its engine is a stand-in here: the check runs in setup, after
    # DeepSpeed's initialisation and before the first forward
    class FP16Engine:
        def fp16_enabled(self):
            return True

    strategy = DPDeepSpeedStrategy(stage=2, clipping="all-layer", clipping_mode="two-pass")
    strategy.attach_engine(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), None, 2)
    with pytest.raises(ValueError, match=r"two-pass.*fp16.*bf16-mixed.*book-keeping"):
        strategy.prepare_clipping_mode(FP16Engine())


def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    for name in ("dp_deepspeed", "dp_deepspeed_stage_0", "dp_deepspeed_stage_1", "dp_deepspeed_stage_2", "dp_deepspeed_stage_2_offload",
                 "dp_deepspeed_stage_3", "dp_deepspeed_stage_3_offload"):
        assert StrategyRegistry[name]["strategy"] is DPDeepSpeedStrategy
    assert StrategyRegistry["dp_deepspeed_stage_3"]["init_params"]["stage"] == 3
    assert StrategyRegistry["dp_deepspeed_stage_0"]["init_params"]["stage"] == 0


class Temperature(Net):
    def __init__(self):
        super().__init__()
        self.log_t = nn.Parameter(torch.zeros(1))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x) / self.log_t.exp(), y)  # a parameter outside any forward


def test_released_zero3_parameter_size_error_is_explained():
    # With several processes a parameter used outside its module's forward is an empty ZeRO-3 partition there,
    # and PyTorch's error mentions only sizes; the strategy adds what happened and the fix.
    from lightning_dpzero.lightning.refusals import explain_released_parameters

    strategy = DPDeepSpeedStrategy(stage=3, noise_multiplier=1.0)
    with pytest.raises(RuntimeError, match=r"(?s)size of tensor b \(0\).*ZeRO-3.*training_step"):
        with explain_released_parameters(strategy.zero_stage):
            raise RuntimeError("The size of tensor a (10) must match the size of tensor b (0) at non-singleton "
                               "dimension 0")
    with pytest.raises(RuntimeError, match="^boom$"):  # other errors pass through untouched
        with explain_released_parameters(strategy.zero_stage):
            raise RuntimeError("boom")


@pytest.mark.parametrize("stage", [2, 3])
def test_parameter_used_in_training_step_is_refused(stage):
    with pytest.raises(UnsupportedLayerError, match="'log_t' received a gradient that did not pass"):
        _fit(Temperature(), DPDeepSpeedStrategy(stage=stage, noise_multiplier=1.0))


BAD_OPTIONS = {
    "loss_reduction": (lambda: DPDeepSpeedStrategy(loss_reduction="avg"),
                       r"loss_reduction='avg' is not supported.*'mean', 'sum'"),
    "clipping_groups": (lambda: DPDeepSpeedStrategy(clipping="group-wise", clipping_groups="groups"),
                        r"clipping_groups='groups' is not supported.*'param_groups'.*patterns"),
    "accountant": (lambda: PrivacyAccountantCallback(accountant="gdp"), r"accountant='gdp' is not supported.*'pld'"),
    "on_budget_exhausted": (lambda: PrivacyAccountantCallback(on_budget_exhausted="warn"),
                            r"on_budget_exhausted='warn'.*'stop', 'raise'"),
}


@pytest.mark.parametrize("make, match", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_string_options_are_refused_when_constructed(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_dp_values_are_logged_exactly_in_float64(tmp_path):
    """Lightning stores a logged Python float as float32, which turned δ = 1e-5 into 9.999999747e-06 in every
    logger; the callback logs float64 tensors, which it keeps."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=1.1)
    trainer = _fit(Net(), strategy, callbacks=[PrivacyAccountantCallback(delta=1e-5)],
                   logger=CSVLogger(tmp_path), log_every_n_steps=1)
    metrics = trainer.callback_metrics
    assert metrics["delta"].item() == 1e-5 and metrics["noise_multiplier"].item() == 1.1
    assert metrics["sample_rate"].item() == strategy.plan.sample_rate == 4 / 32
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("delta")]
    assert rows and {float(r["delta"]) for r in rows} == {1e-5}
