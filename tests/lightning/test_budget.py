"""The privacy budget stop, what the callback logs (sanity check, σ = 0, second accountant), the refusal of
custom samplers, the ledger's independence of the process layout, and exporting a ZeRO checkpoint with its
ledger."""

import json
import logging
import math
import shutil

import dp_accounting
import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.states import RunningStage
from torch import nn
from torch.utils.data import (BatchSampler, DataLoader, SequentialSampler, SubsetRandomSampler,
                              WeightedRandomSampler)
from torch.utils.data.distributed import DistributedSampler

import lightning_dpzero  # noqa: F401
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback, PrivacyLedger
from lightning_dpzero.accounting import LedgerEntry, value_discretization_interval
from lightning_dpzero.accounting import LedgerIntegrityError, PrivacyBudgetExceeded
from lightning_dpzero.sampling import check_sampler_describable, dataset_size, private_dataloader

from tiny_module import N, Net
from tiny_module import dataset as _dataset


class ValNet(Net):
    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.body(x), y), sync_dist=True)

    def val_dataloader(self):
        return DataLoader(_dataset(), batch_size=8)


def _fit(model, strategy, callbacks, **trainer_kw):
    kw = dict(max_steps=-1, max_epochs=-1, num_sanity_val_steps=0)
    kw.update(trainer_kw)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), **kw)
    trainer.fit(model)
    return trainer


def _pld_epsilon(q, sigma, steps, delta=1e-5):
    """ε of `steps` Poisson-subsampled Gaussian steps by dp-accounting accountants built here: the smaller of a
    PLDAccountant on the grid the package chose for them and an RdpAccountant."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    pld = dp_accounting.pld.PLDAccountant(
        value_discretization_interval=value_discretization_interval([LedgerEntry(q, sigma, steps)], delta))
    rdp = dp_accounting.rdp.RdpAccountant()
    pld.compose(event)
    rdp.compose(event)
    return min(pld.get_epsilon(delta), rdp.get_epsilon(delta))


def _last_step_within(q, sigma, target):
    k = 0
    while _pld_epsilon(q, sigma, k + 1) <= target:
        k += 1
    return k


# ------------------------------------------------------------------------------------------------ budget stop
# q = B·K/N = 2·2/32 = 0.125, σ = 2: the target ε = 1 runs out mid-training (after 9 steps)
Q, SIGMA, TARGET = 0.125, 2.0, 1.0


def test_budget_stops_before_the_step_that_would_exceed(caplog):
    k = _last_step_within(Q, SIGMA, TARGET)
    assert 3 <= k <= 20
    cb = PrivacyAccountantCallback(target_epsilon=TARGET)
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=SIGMA)
    model = Net()
    with caplog.at_level(logging.INFO):
        trainer = _fit(model, strategy, [cb], accumulate_grad_batches=2)  # unbounded: only the budget stops it
    assert strategy.plan.sample_rate == Q and strategy.plan.planned_steps is None
    assert strategy.ledger.steps == trainer.global_step == k
    assert model.micro_batches == 2 * k  # not one micro-batch of step k+1 ran
    assert cb.budget_exhausted
    assert cb.epsilon() <= TARGET < _pld_epsilon(Q, SIGMA, k + 1)
    assert cb.epsilon() == pytest.approx(_pld_epsilon(Q, SIGMA, k), rel=1e-9)
    assert trainer.callback_metrics["dp_steps"] == k
    assert "Privacy budget exhausted" in caplog.text and "Stopping training" in caplog.text
    assert caplog.text.count("Privacy budget exhausted") == 1


def test_budget_raise_mode_raises_before_the_step():
    k = _last_step_within(Q, SIGMA, TARGET)
    cb = PrivacyAccountantCallback(target_epsilon=TARGET, on_budget_exhausted="raise")
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=SIGMA)
    model = Net()
    with pytest.raises(PrivacyBudgetExceeded, match=r"one more step.*target_epsilon = 1"):
        _fit(model, strategy, [cb], accumulate_grad_batches=2)
    assert strategy.ledger.steps == k and model.micro_batches == 2 * k
    assert strategy.ledger.epsilon() <= TARGET


def test_min_steps_beyond_the_budget_refuses_the_step():
    k = _last_step_within(Q, SIGMA, TARGET)
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=SIGMA)
    with pytest.raises(PrivacyBudgetExceeded, match="min_steps"):
        _fit(Net(), strategy, [PrivacyAccountantCallback(target_epsilon=TARGET)], accumulate_grad_batches=2,
             min_steps=k + 2)
    assert strategy.ledger.steps == k


def test_calibrated_sigma_runs_every_planned_step():
    cb = PrivacyAccountantCallback(target_epsilon=TARGET)
    strategy = DPDeepSpeedStrategy(stage=2)
    trainer = _fit(Net(), strategy, [cb], max_steps=12, accumulate_grad_batches=2)
    assert trainer.global_step == strategy.ledger.steps == 12
    assert not cb.budget_exhausted
    assert TARGET * 0.99 <= cb.epsilon() <= TARGET


def test_budget_too_small_for_one_step_trains_nothing():
    model = Net()
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=0.5)
    cb = PrivacyAccountantCallback(target_epsilon=0.05)
    trainer = _fit(model, strategy, [cb])
    assert trainer.global_step == 0 and model.micro_batches == 0 and cb.budget_exhausted
    assert cb.epsilon() == 0.0


def test_target_without_sigma_or_bound_is_refused():
    with pytest.raises(ValueError, match="bounded run.*noise_multiplier"):
        _fit(Net(), DPDeepSpeedStrategy(stage=2), [PrivacyAccountantCallback(target_epsilon=1.0)])


def test_bounded_sigma_contradicting_target_says_how_many_steps_fit():
    k = _last_step_within(Q, SIGMA, TARGET)
    with pytest.raises(ValueError, match=rf"target_epsilon.*only {k} steps fit"):
        _fit(Net(), DPDeepSpeedStrategy(stage=2, noise_multiplier=SIGMA),
             [PrivacyAccountantCallback(target_epsilon=TARGET)], max_steps=k + 1, accumulate_grad_batches=2)


@pytest.mark.parametrize("kwargs, match", [(dict(on_budget_exhausted="warn"), "on_budget_exhausted"),
                                           (dict(target_epsilon=math.inf), "target_epsilon"),
                                           (dict(target_epsilon=0.0), "target_epsilon")])
def test_bad_callback_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrivacyAccountantCallback(**kwargs)


# ------------------------------------------------------------------------------------------------ logging
class _Probe(L.Callback):
    def __init__(self, cb):
        self.cb, self.seen = cb, {}

    def on_sanity_check_end(self, trainer, pl_module):
        self.seen["sanity"] = (set(trainer.callback_metrics), self.cb.epsilon())

    def on_train_start(self, trainer, pl_module):
        self.seen["train_start"] = (set(trainer.callback_metrics), self.cb.epsilon())


def test_nothing_logged_during_sanity_check_and_epsilon_zero_before_first_step():
    cb = PrivacyAccountantCallback(log_second_accountant=True)
    probe = _Probe(cb)
    # clip_fraction is logged for a step with examples only: at q = 2/32 an unseeded run drew an empty last
    # (logged) step one time in eight, and this test failed; a seed fixes the draws, q = 8/32 makes them full
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0, seed=0)
    trainer = _fit(ValNet(batch_size=8), strategy, [cb, probe], max_steps=3, num_sanity_val_steps=2,
                   limit_val_batches=1)
    for when in ("sanity", "train_start"):
        metrics, eps = probe.seen[when]
        assert eps == 0.0
        assert not metrics & {"epsilon", "epsilon_rdp", "dp_steps", "noise_multiplier", "clip_fraction"}, when
    m = trainer.callback_metrics
    ledger = strategy.ledger
    # at 3 steps the tracker's grid is exact: logged values are the exact ε of each accountant (as float32)
    assert float(m["epsilon"]) == pytest.approx(ledger.epsilon(), rel=1e-6)
    assert float(m["epsilon_rdp"]) == pytest.approx(ledger.epsilon(accountant="rdp"), rel=1e-6)
    assert float(m["epsilon_rdp"]) >= float(m["epsilon"]) > 0
    assert 0.0 <= float(m["clip_fraction"]) <= 1.0 and float(m["dp_steps"]) == 3


def test_second_accountant_of_an_rdp_run_is_pld():
    cb = PrivacyAccountantCallback(accountant="rdp", log_second_accountant=True)
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0)
    trainer = _fit(Net(), strategy, [cb], max_steps=2)
    m = trainer.callback_metrics
    assert "epsilon_pld" in m and "epsilon_rdp" not in m
    assert float(m["epsilon"]) == pytest.approx(strategy.ledger.epsilon(accountant="rdp"), rel=1e-6)
    assert float(m["epsilon_pld"]) == pytest.approx(strategy.ledger.epsilon(accountant="pld"), rel=1e-6)


def test_sigma_zero_logs_inf_with_one_warning_and_finishes():
    cb = PrivacyAccountantCallback(log_second_accountant=True)
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=0.0)
    with pytest.warns(UserWarning, match="noise_multiplier=0") as record:
        trainer = _fit(Net(), strategy, [cb], max_steps=4)
    assert sum("noise_multiplier=0" in str(w.message) for w in record) == 1
    assert trainer.global_step == 4
    assert cb.epsilon() == math.inf and cb.epsilon(exact=False) == math.inf
    assert float(trainer.callback_metrics["epsilon"]) == math.inf
    assert float(trainer.callback_metrics["epsilon_rdp"]) == math.inf


def test_sigma_zero_with_a_budget_takes_no_step():
    model = Net()
    cb = PrivacyAccountantCallback(target_epsilon=10.0)
    with pytest.warns(UserWarning, match="noise_multiplier=0"):
        trainer = _fit(model, DPDeepSpeedStrategy(stage=2, noise_multiplier=0.0), [cb])  # unbounded
    assert trainer.global_step == 0 and model.micro_batches == 0 and cb.budget_exhausted


# ------------------------------------------------------------------------------------------------ samplers
class MySampler(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self):
        return self.n // 2


class MyBatchSampler(BatchSampler):
    pass


def test_check_sampler_describable_accepts_plain_sampling():
    ds = _dataset()
    for loader in [DataLoader(ds, batch_size=4), DataLoader(ds, batch_size=4, shuffle=True),
                   DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=2, rank=0)),
                   private_dataloader(DataLoader(ds, batch_size=4), 0.125, 1, 0)]:
        check_sampler_describable(loader)


@pytest.mark.parametrize("make, name", [
    (lambda ds: DataLoader(ds, batch_size=4, sampler=WeightedRandomSampler([1.0] * N, N)), "WeightedRandomSampler"),
    (lambda ds: DataLoader(ds, batch_size=4, sampler=SubsetRandomSampler(range(8))), "SubsetRandomSampler"),
    (lambda ds: DataLoader(ds, batch_size=4, sampler=MySampler(N)), "MySampler"),
    (lambda ds: DataLoader(ds, batch_sampler=MyBatchSampler(SequentialSampler(ds), 4, False)), "MyBatchSampler"),
    (lambda ds: DataLoader(ds, batch_sampler=BatchSampler(WeightedRandomSampler([1.0] * N, N), 1, False)),
     "WeightedRandomSampler"),
    (lambda ds: DataLoader(ds, batch_size=4, sampler=_lightning_wrapped(MySampler(N))), "MySampler"),
])
def test_check_sampler_describable_refuses_custom_samplers(make, name):
    with pytest.raises(ValueError, match=rf"{name}.*accountant cannot describe.*Remove.*Poisson sampling"):
        check_sampler_describable(make(_dataset()))


def _lightning_wrapped(sampler):
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    return DistributedSamplerWrapper(sampler, num_replicas=2, rank=0, shuffle=False)


class _CheckingStrategy(DPDeepSpeedStrategy):
    """The DP strategy with the sampler check where process_dataloader will call it."""

    def process_dataloader(self, dataloader):
        trainer = self.lightning_module.trainer
        if trainer.state.stage == RunningStage.TRAINING and self.per_sample is not None:
            dataset_size(dataloader)
            check_sampler_describable(dataloader)
        return super().process_dataloader(dataloader)


def test_custom_sampler_is_refused_before_training():
    model = Net(loader_kw=dict(sampler=WeightedRandomSampler([1.0] * N, N)))
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        _fit(model, _CheckingStrategy(stage=2, noise_multiplier=1.0), [PrivacyAccountantCallback()], max_steps=2)
    assert model.micro_batches == 0
    model = Net(loader_kw=dict(shuffle=True))  # the same path accepts a plain shuffled loader
    assert _fit(model, _CheckingStrategy(stage=2, noise_multiplier=1.0), [], max_steps=2).global_step == 2


# ------------------------------------------------------------------------------------------------ multi-process
BASE = dict(model="token", n=64, lr=0.5, sigma=None, target_epsilon=3.0, C=0.5, clipping="layer-wise",
            clipping_fn="abadi", poisson=True, stage=3, steps=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-process launch (accumulate 2 × 2 processes × b = 2, saving a ZeRO-3 checkpoint; and an unbounded
    run that the budget stops) and one 1-process launch (accumulate 1 × b = 8) on the same N."""
    from harness import run_cases

    tmp = tmp_path_factory.mktemp("budget")
    ckpt = tmp / "ckpt"
    two = run_cases([dict(BASE, name="w2k2", batch_size=2, accumulate=2, save_path=str(ckpt)),
                     dict(BASE, name="stop2", batch_size=4, accumulate=1, sigma=SIGMA, target_epsilon=TARGET,
                          steps=-1, max_epochs=-1, log_second_accountant=True, record_metrics=True)],
                    tmp / "out2", 2)
    one = run_cases([dict(BASE, name="w1k1", batch_size=8, accumulate=1)], tmp / "out1", 1)
    return {**two, **one, "ckpt": ckpt, "tmp": tmp}


def _entries(ledger_dict):
    return [{k: e[k] for k in ("sample_rate", "noise_multiplier", "steps", "sampler")} for e in ledger_dict["entries"]]


@pytest.mark.slow
def test_ledger_does_not_depend_on_processes_and_accumulation(runs):
    a, b = runs["w2k2"], runs["w1k1"]
    assert _entries(a["ledger"]) == _entries(b["ledger"])
    assert _entries(a["ledger"]) == [{"sample_rate": 8 / 64, "noise_multiplier": a["plan"]["noise_multiplier"],
                                      "steps": 4, "sampler": "poisson"}]
    assert a["ledger"]["dataset_size"] == b["ledger"]["dataset_size"] == 64
    assert a["plan"]["noise_multiplier"] == b["plan"]["noise_multiplier"]
    assert a["plan"]["expected_batch_size"] == b["plan"]["expected_batch_size"] == 8
    assert a["epsilon"] == b["epsilon"] and 0.99 * 3.0 <= a["epsilon"] <= 3.0
    assert a["global_step"] == b["global_step"] == 4


@pytest.mark.slow
def test_budget_stop_on_two_processes_agrees_across_ranks(runs, tmp_path):
    r = runs["stop2"]
    q = 4 * 2 / 64
    k = _last_step_within(q, SIGMA, TARGET)
    assert r["global_step"] == k and _entries(r["ledger"])[0]["steps"] == k
    assert r["epsilon"] <= TARGET < _pld_epsilon(q, SIGMA, k + 1)
    out = runs["tmp"] / "out2"
    m0, m1 = (json.loads((out / f"stop2.metrics{rank}.json").read_text()) for rank in (0, 1))
    keys = ("epsilon", "epsilon_rdp", "dp_steps", "clip_fraction", "mean_grad_norm")
    assert {k_: m0[k_] for k_ in keys} == {k_: m1[k_] for k_ in keys}
    assert m0["dp_steps"] == k


@pytest.mark.slow
def test_export_zero3_checkpoint_with_ledger(runs, tmp_path):
    from lightning_dpzero.checkpoints import convert_zero_checkpoint_with_ledger, exported_ledger

    ckpt = runs["ckpt"]
    source = PrivacyLedger.load(ckpt / "privacy_ledger.json")
    assert source == PrivacyLedger.from_dict(runs["w2k2"]["ledger"]) and source.steps == 4

    out = convert_zero_checkpoint_with_ledger(ckpt, tmp_path / "model.ckpt")
    assert out.embedded and out.ledger_file == tmp_path / "model.ckpt.privacy_ledger.json"
    assert PrivacyLedger.load(out.ledger_file) == source
    saved = torch.load(tmp_path / "model.ckpt", map_location="cpu", weights_only=False)
    embedded = PrivacyLedger.from_dict(saved["privacy_ledger"])
    assert embedded == source and embedded.head == source.head
    final = runs["w2k2"]["final"]  # parameters gathered from the ZeRO-3 shards at the end of the run
    assert set(saved["state_dict"]) == set(final)
    for name, value in final.items():
        torch.testing.assert_close(saved["state_dict"][name].float(), value, rtol=0, atol=0)
    assert exported_ledger(tmp_path / "model.ckpt", trust_file=True) == source

    out_dir = convert_zero_checkpoint_with_ledger(ckpt, str(tmp_path / "hf") + "/")
    assert not out_dir.embedded and out_dir.ledger_file == tmp_path / "hf" / "privacy_ledger.json"
    assert exported_ledger(tmp_path / "hf") == source
    weights = torch.load(tmp_path / "hf" / "pytorch_model.bin", map_location="cpu", weights_only=True)
    assert set(weights) == set(final)

    # an edited ledger, or none, is refused before anything is written
    bad = tmp_path / "edited"
    shutil.copytree(ckpt, bad)
    doc = json.loads((bad / "privacy_ledger.json").read_text())
    doc["entries"][0]["steps"] = 1
    (bad / "privacy_ledger.json").write_text(json.dumps(doc))
    with pytest.raises(LedgerIntegrityError):
        convert_zero_checkpoint_with_ledger(bad, tmp_path / "bad.ckpt")
    assert not (tmp_path / "bad.ckpt").exists()
