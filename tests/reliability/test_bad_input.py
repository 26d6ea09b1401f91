"""Bad input (issue #5, docs/reliability.md §2): each is a clear error before the first optimizer step, naming
the setting and the fix, with nothing trained; or a warning where training can go on. Single-process Lightning
runs (DeepSpeed on the CPU, 1 device)."""

import json
import math
import os
import shutil

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import lightning_dpzero  # noqa: F401
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback, UnsupportedLayerError
from lightning_dpzero.checkpoints import CheckpointIntegrityError, IncompleteCheckpointError
from lightning_dpzero.mechanism import NonFiniteLossError

N = 32


class Net(L.LightningModule):
    def __init__(self, body=None, data=None, bad_loss_at=None, bad_value=float("nan")):
        super().__init__()
        self.body = body or nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.data = data
        self.bad_loss_at, self.bad_value = bad_loss_at, bad_value
        self.steps_run = 0
        self.after_step = {}

    def training_step(self, batch, _):
        if torch.is_grad_enabled():  # not the strategy's layout check, which re-runs it without gradients
            self.steps_run += 1
        x, y = batch
        loss = nn.functional.cross_entropy(self.body(x).flatten(1), y)
        if self.bad_loss_at is not None and self.global_step == self.bad_loss_at:
            loss = loss * self.bad_value
        return loss

    def on_train_batch_end(self, *args):
        self.after_step[self.global_step] = _params(self)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        if self.data is not None:
            return self.data
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(N, 4, generator=g), torch.randint(0, 2, (N,), generator=g)),
                          batch_size=4)


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _trainer(strategy, callbacks=(), max_steps=2, **kw):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=list(callbacks), **kw)


def _refused(model, strategy, error, match, callbacks=(), ckpt_path=None, **kw):
    """The fit raises ``error`` matching ``match`` and trains nothing: no training step ran, and the parameters
    are the initial ones (or, when resuming, possibly the checkpoint's, loaded before the ledger is checked)."""
    before = _params(model)
    saved = _checkpoint_weights(ckpt_path) if ckpt_path is not None else {}
    with pytest.raises(error, match=match):
        _trainer(strategy, callbacks, **kw).fit(model, ckpt_path=ckpt_path)
    assert model.steps_run == 0, "a training step ran before the refusal"
    after = _params(model)
    assert all(torch.equal(before[k], after[k]) or (k in saved and torch.equal(saved[k], after[k]))
               for k in before), "parameters changed"


def _checkpoint_weights(ckpt):
    state = torch.load(f"{ckpt}/checkpoint/mp_rank_00_model_states.pt", weights_only=True)["module"]
    return {k[k.index("body."):]: v for k, v in state.items()}


# ------------------------------------------------------------------------------------------------ settings
@pytest.mark.parametrize("kwargs, match", [
    (dict(noise_multiplier=-1.0), r"noise_multiplier \(σ\) must be >= 0 and finite"),
    (dict(noise_multiplier=float("nan")), r"noise_multiplier"),
    (dict(noise_multiplier=math.inf), r"noise_multiplier"),
    (dict(noise_multiplier=1.0, max_grad_norm=0.0), r"max_grad_norm \(C\) must be > 0"),
    (dict(noise_multiplier=1.0, max_grad_norm=-1.0), r"max_grad_norm \(C\) must be > 0"),
    (dict(noise_multiplier=1.0, max_grad_norm=float("nan")), r"max_grad_norm"),
])
def test_bad_sigma_or_clipping_norm(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPDeepSpeedStrategy(stage=2, **kwargs)


@pytest.mark.parametrize("delta", [0.0, -1e-5, 1.0, 1.5])
def test_bad_delta(delta):
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\).*1e-5 or below 1/N"):
        PrivacyAccountantCallback(delta=delta)


def test_delta_above_one_over_n_warns_and_trains():
    model = Net()
    with pytest.warns(UserWarning, match=r"delta=0.1 >= 1/N.*well below 1/N"):
        _trainer(DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0),
                 [PrivacyAccountantCallback(delta=0.1)]).fit(model)
    assert model.steps_run == 2


def test_sample_rate_above_one_is_refused():
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=16)
    _refused(Net(data=data), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), ValueError,
             r"q = batch_size 16 .* > 1.*Lower batch_size")


class _NoLen(Dataset):
    def __getitem__(self, i):
        return torch.randn(4), torch.tensor(i % 2)


class _Stream(IterableDataset):
    def __iter__(self):
        for i in range(N):
            yield torch.randn(4), torch.tensor(i % 2)


def test_dataset_of_unknown_length_is_refused():
    _refused(Net(data=DataLoader(_NoLen(), batch_size=4)), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0),
             TypeError, r"'_NoLen' has no len\(\).*training set's size N: give the training dataset a __len__")


def test_iterable_dataset_is_refused():
    _refused(Net(data=DataLoader(_Stream(), batch_size=4)), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0),
             TypeError, r"IterableDataset.*map-style Dataset")


def test_gradient_clip_val_is_refused():
    _refused(Net(), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), ValueError,
             r"gradient_clip_val=1.0.*Remove gradient_clip_val and set the strategy's max_grad_norm",
             gradient_clip_val=1.0)


def test_deepspeed_gradient_clipping_is_refused():
    cfg = {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 4}
    _refused(Net(), DPDeepSpeedStrategy(config=cfg, noise_multiplier=1.0), ValueError,
             r"gradient_clipping=1.0.*Remove it from the config")


class _Misused(nn.Module):
    """A raw parameter used as a weight matrix next to a trainable child: not a broadcast over the batch, so no
    per-example gradient is formed for it (a parameter broadcast over the batch, a layer scale, trains)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.eye(8))
        self.inner = nn.Linear(8, 8)

    def forward(self, x):
        return self.inner(x) @ self.w


def test_unsupported_layer_is_refused():
    body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    _refused(Net(body), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), UnsupportedLayerError,
             r"(?s)BatchNorm1d.*body\.1.*GroupNorm")


def test_a_parameter_used_as_a_weight_matrix_is_refused_before_the_first_update():
    """The layout check's forwards run without gradients, where such a use cannot be told from a broadcast; the
    first clipped forward refuses it (naming the module and the parameter), before anything is updated."""
    model = Net(nn.Sequential(nn.Linear(4, 8), _Misused(), nn.Linear(8, 2)))
    before = _params(model)
    with pytest.raises(UnsupportedLayerError, match=r"(?s)_Misused 'body\.1'"):
        _trainer(DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0)).fit(model)
    assert model.steps_run <= 1
    after = _params(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "an update was applied before the refusal"


# ------------------------------------------------------------------------------------------------ losses
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_non_finite_loss_stops_with_the_step_charged(bad, accumulate):
    """A NaN/inf loss at the second optimizer step: error naming the step and the fix; that step is charged
    (not silently skipped) and not applied."""
    model = Net(bad_loss_at=1, bad_value=bad)
    # a fixed seed: with a drawn one, the bad step's Poisson batch was empty about once in 70 runs, and the
    # loss of an empty batch is replaced by 0 whatever training_step returns (no example, no gradient)
    strategy = DPDeepSpeedStrategy(stage=2 if accumulate == 1 else 0, noise_multiplier=1.0, seed=0)
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss at optimizer step 2.*charged to the privacy "
                                                 r"ledger \(2 steps, ε = .*Fix the cause"):
        _trainer(strategy, [PrivacyAccountantCallback()], max_steps=4,
                 accumulate_grad_batches=accumulate).fit(model)
    assert strategy.ledger.steps == 2
    assert max(model.after_step) == 1
    now = _params(model)
    assert all(torch.equal(now[k], model.after_step[1][k]) for k in now), "the bad step was applied"
    assert all(torch.isfinite(p).all() for p in now.values())


def test_a_cut_epoch_is_refused_in_one_process_too():
    _refused(Net(), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), ValueError,
             r"limit_train_batches=3\) runs 3 micro-batches.*Use limit_train_batches=2 or 4, a multiple of "
             r"accumulate_grad_batches=2", max_steps=-1, max_epochs=2, limit_train_batches=3,
             accumulate_grad_batches=2)


def test_counters_that_drift_apart_stop_training_before_the_update(monkeypatch):
    """The safety net under the window refusals: with them and the explicit DeepSpeed boundary taken away (the
    behaviour before they existed), DeepSpeed's own micro-step counter drifts from Lightning's per-epoch one at
    the first epoch boundary, and the step-counter check stops training before that update is applied."""
    import lightning_dpzero.lightning.loop as loop

    monkeypatch.setattr(lightning_dpzero.lightning.refusals, "check_whole_windows", lambda *a: None)
    monkeypatch.setattr(loop, "closes_window", lambda trainer: None)  # None: DeepSpeed's own counter decides
    model, strategy = Net(), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0)
    with pytest.raises(RuntimeError, match=r"counters disagree before an update \(ledger steps 2 \(\+2 this fit\), "
                                           r"Lightning global_step 1 \(\+1 this fit\), DeepSpeed global_steps 2"):
        _trainer(strategy, max_steps=-1, max_epochs=3, limit_train_batches=3, accumulate_grad_batches=2).fit(model)
    now = _params(model)
    assert max(model.after_step) == 1 and all(torch.equal(now[k], model.after_step[1][k]) for k in now), \
        "the drifted update was applied"


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def dp_checkpoints(tmp_path_factory):
    """Two DP runs of 2 steps (different run ids), each saved as a checkpoint directory."""
    root = tmp_path_factory.mktemp("ckpts")
    paths = []
    saved = dict(os.environ)  # an in-process Trainer sets RANK, LOCAL_RANK, MASTER_PORT...: later subprocesses
    try:                      # must not inherit them (this fixture outlives the per-test environment reset)
        for name in ("a", "b"):
            trainer = _trainer(DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), [PrivacyAccountantCallback()])
            trainer.fit(Net())
            trainer.save_checkpoint(root / name)
            paths.append(root / name)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return paths


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_resume_with_other_dataset_size_is_refused(dp_checkpoints):
    data = DataLoader(TensorDataset(torch.randn(2 * N, 4), torch.randint(0, 2, (2 * N,))), batch_size=4)
    _refused(Net(data=data), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), ValueError,
             rf"ledger is for N={N}.*this run has N={2 * N}.*same data and delta",
             callbacks=[PrivacyAccountantCallback()], ckpt_path=dp_checkpoints[0], max_steps=4)


def test_resume_with_other_delta_is_refused(dp_checkpoints):
    _refused(Net(), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), ValueError,
             r"δ=1e-05; this run has .*δ=1e-06.*same data and delta",
             callbacks=[PrivacyAccountantCallback(delta=1e-6)], ckpt_path=dp_checkpoints[0], max_steps=4)


def test_ledger_file_from_another_run_is_refused(dp_checkpoints, tmp_path):
    mixed = _copy(dp_checkpoints[0], tmp_path / "mixed")
    shutil.copy(dp_checkpoints[1] / "privacy_ledger.json", mixed / "privacy_ledger.json")
    _refused(Net(), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), CheckpointIntegrityError,
             r"privacy_ledger.json: size/SHA-256 .* differ.*Nothing was loaded",
             callbacks=[PrivacyAccountantCallback()], ckpt_path=mixed, max_steps=4)


def test_ledger_and_marker_from_another_run_are_refused(dp_checkpoints, tmp_path):
    """Even a consistent-looking swap (ledger file and marker rewritten to match) disagrees with the ledger in
    the client state, so it is refused."""
    mixed = _copy(dp_checkpoints[0], tmp_path / "mixed")
    shutil.copy(dp_checkpoints[1] / "privacy_ledger.json", mixed / "privacy_ledger.json")
    commit = json.loads((mixed / "privacy_commit.json").read_text())
    other = json.loads((dp_checkpoints[1] / "privacy_commit.json").read_text())
    commit["files"]["privacy_ledger.json"] = other["files"]["privacy_ledger.json"]
    commit.update(run_id=other["run_id"], ledger_head=other["ledger_head"])
    (mixed / "privacy_commit.json").write_text(json.dumps(commit))
    _refused(Net(), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), CheckpointIntegrityError,
             r"ledger inside the checkpoint disagree.*another run",
             callbacks=[PrivacyAccountantCallback()], ckpt_path=mixed, max_steps=4)


def test_checkpoint_without_a_ledger_is_refused(dp_checkpoints, tmp_path):
    """A DeepSpeed checkpoint of a non-DP run (Lightning's own DeepSpeedStrategy refuses the CPU, so: a DP
    checkpoint with every privacy record stripped)."""
    plain = _copy(dp_checkpoints[0], tmp_path / "c")
    for name in ("privacy_ledger.json", "privacy_commit.json"):
        (plain / name).unlink()
    f = plain / "checkpoint" / "mp_rank_00_model_states.pt"
    state = torch.load(f, weights_only=True)
    state.pop("privacy_ledger", None)
    state.get("callbacks", {}).pop("PrivacyAccountantCallback", None)
    torch.save(state, f)
    _refused(Net(), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), ValueError,
             r"holds no privacy ledger.*Resume only from checkpoints written by DPDeepSpeedStrategy",
             callbacks=[PrivacyAccountantCallback()], ckpt_path=plain, max_steps=3)


def test_half_written_checkpoint_is_refused(dp_checkpoints, tmp_path):
    broken = _copy(dp_checkpoints[0], tmp_path / "broken")
    (broken / "privacy_commit.json").unlink()
    (broken / ".privacy_checkpoint_incomplete").write_text("")
    _refused(Net(), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), IncompleteCheckpointError,
             r"no privacy_commit.json: its save was interrupted.*Nothing was loaded",
             callbacks=[PrivacyAccountantCallback()], ckpt_path=broken, max_steps=4)


def test_truncated_shard_is_refused(dp_checkpoints, tmp_path):
    broken = _copy(dp_checkpoints[0], tmp_path / "broken")
    shard = next((broken / "checkpoint").glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])
    _refused(Net(), DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), CheckpointIntegrityError,
             r"optim_states.pt: size/SHA-256 100/.*Nothing was loaded",
             callbacks=[PrivacyAccountantCallback()], ckpt_path=broken, max_steps=4)
