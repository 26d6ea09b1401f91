"""Security (issue #5, docs/reliability.md §3): secure mode is not reproducible from any seed; no seed, generator
state, per-example quantity or raw gradient reaches a checkpoint or a log; everything we load is loaded safely;
a resumed run never reuses a noise draw."""

import ast
import csv
import json
import re
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_dpzero
import lightning_dpzero.noise as noise_module
from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback
from lightning_dpzero.checkpoints import UnsafeCheckpointError

PACKAGE = Path(lightning_dpzero.__file__).parent
N, B = 48, 4


class Indexed(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class Net(L.LightningModule):
    def __init__(self, optimizer="sgd"):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))
        self.optimizer = optimizer
        self.seen = []

    def on_train_batch_start(self, batch, _):
        self.seen.append(batch[2].tolist())  # not in training_step, which the layout check runs again

    def training_step(self, batch, _):
        x, y, idx = batch
        loss = nn.functional.cross_entropy(self.body(x), y)
        self.log("train_loss", loss, batch_size=max(len(x), 1))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam if self.optimizer == "adam" else torch.optim.SGD
        return opt(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(Indexed(), batch_size=B)


def _fit(strategy, steps=3, ckpt_path=None, logger=False, optimizer="sgd", callbacks=()):
    L.seed_everything(0, verbose=False)
    model = Net(optimizer)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=logger,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[PrivacyAccountantCallback(), *callbacks], log_every_n_steps=1)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ----------------------------------------------------------------------------------------------- secure mode
def test_secure_mode_is_not_reproduced_by_any_seed():
    """Same seed, same initial weights, same data: the seeded runs agree exactly, the secure runs do not (noise
    and batches both come from the OS CSPRNG)."""
    runs = {mode: [_fit(DPDeepSpeedStrategy(stage=0, noise_multiplier=1.0, seed=42, secure_mode=mode))[1]
                   for _ in range(2)] for mode in (False, True)}
    seeded, secure = runs[False], runs[True]
    assert torch.equal(_params(seeded[0]), _params(seeded[1])) and seeded[0].seen == seeded[1].seen
    assert not torch.allclose(_params(secure[0]), _params(secure[1]))
    assert secure[0].seen != secure[1].seen
    assert not torch.allclose(_params(secure[0]), _params(seeded[0]))


# ----------------------------------------------------------------------------------------------- no leaks
class RecordingLogger(Logger):
    """Every metric any logger would receive."""

    def __init__(self):
        super().__init__()
        self.metrics, self.hparams = [], []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs):
        self.hparams.append(params)


ALLOWED_METRICS = {"train_loss", "epsilon", "delta", "noise_multiplier", "sample_rate", "dp_steps", "clip_fraction",
                   "mean_grad_norm", "epoch", "step", "epsilon_rdp", "epsilon_pld"}
# DeepSpeed's model-states file and Lightning's checkpoint keys, plus our ledger: nothing else may appear.
ALLOWED_TOP_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "epoch", "global_step", "pytorch-lightning_version", "loops", "callbacks",
    "lr_schedulers", "hparams_name", "hyper_parameters", "privacy_ledger",
    # ZeRO optimizer-state files
    "optimizer_state_dict",
}


def _walk(obj, path=""):
    """(path, leaf) for every leaf of nested dicts/lists/tuples/objects."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]")
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, type)):
        yield from _walk(vars(obj), path + "<obj>")
    else:
        yield path, obj


def _secrets_of(strategy):
    """Byte patterns of the strategy's seed: decimal, hex, and 8-byte little-endian (as pickle stores it)."""
    s = int(strategy.seed)
    return s, [str(s).encode(), format(s, "x").encode(), s.to_bytes(8, "little", signed=True)]


def _assert_no_secret_in_files(root, strategy):
    seed, patterns = _secrets_of(strategy)
    files = [p for p in Path(root).rglob("*") if p.is_file()]
    assert files
    for f in files:
        data = f.read_bytes()
        for pat in patterns:
            assert pat not in data, f"the noise/sampling seed {seed} is written in {f}"


@pytest.mark.parametrize("secure", [False, True])
def test_no_seed_generator_state_per_example_quantity_or_gradient_in_checkpoints_and_logs(tmp_path, secure):
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0, secure_mode=secure,
                                   seed=None if secure else 987654321987654321)
    recorder, csv_logger = RecordingLogger(), CSVLogger(tmp_path / "logs")
    trainer, model = _fit(strategy, steps=3, logger=[recorder, csv_logger], optimizer="adam")
    trainer.save_checkpoint(tmp_path / "ckpt")
    trainer.logger.save()

    # 1. no seed anywhere on disk (checkpoint files, ledger, commit marker, logs)
    _assert_no_secret_in_files(tmp_path, strategy)

    # 2. logged metrics: the documented scalars only (no per-example vectors, nothing secret)
    seed = int(strategy.seed)
    assert recorder.metrics
    for row in recorder.metrics:
        assert set(row) <= ALLOWED_METRICS, set(row) - ALLOWED_METRICS
        for name, value in row.items():
            value = float(value.item() if isinstance(value, torch.Tensor) else value)  # scalars only
            assert value != seed
    with open(next(Path(tmp_path / "logs").rglob("metrics.csv"))) as f:
        assert set(next(csv.reader(f))) <= ALLOWED_METRICS

    # 3. checkpoint contents: known keys only; every tensor is a parameter, a flat ZeRO partition of the
    #    parameters, or an optimizer scalar; no generator state, no per-example or batch-shaped tensor
    n_params = sum(p.numel() for p in model.parameters())
    param_shapes = {tuple(p.shape) for p in model.parameters()}
    files = sorted((tmp_path / "ckpt").rglob("*.pt"))
    assert files
    for f in files:
        state = torch.load(f, map_location="cpu", weights_only=False)
        assert set(state) <= ALLOWED_TOP_KEYS, (f.name, set(state) - ALLOWED_TOP_KEYS)
        for path, leaf in _walk(state):
            if isinstance(leaf, torch.Tensor):
                assert not re.search(r"grad|norm|per_sample|activation|generator|rng|seed|noise", path,
                                     re.IGNORECASE), f"{f.name}:{path}: a tensor named like a gradient or norm"
                partition = leaf.dim() == 1 and n_params <= leaf.numel() <= n_params + 64  # + ZeRO alignment
                ok = tuple(leaf.shape) in param_shapes or partition or leaf.numel() <= 1
                assert ok, f"{f.name}:{path} has shape {tuple(leaf.shape)}: not a parameter or partition"
                assert leaf.dtype != torch.uint8, f"{f.name}:{path}: a byte tensor (a generator state?)"
                assert B not in leaf.shape[:1] or tuple(leaf.shape) in param_shapes, path
            elif isinstance(leaf, (int, np.integer)) and not isinstance(leaf, bool):
                assert int(leaf) != seed, f"{f.name}:{path} holds the seed"
    commit = json.loads((tmp_path / "ckpt" / "privacy_commit.json").read_text())
    assert "seed" not in json.dumps(commit).lower()


# ----------------------------------------------------------------------------------------------- resume
def test_resume_never_reuses_a_noise_draw(tmp_path, monkeypatch):
    """With an explicit seed, the resumed process must not restart the noise stream: a repeated draw would
    cancel in the difference of two released updates. Every draw of the whole lineage must be distinct."""
    draws = []
    original = noise_module.NoiseSource.normal

    def recording(self, shape, device):
        z = original(self, shape, device)
        draws.append(z.detach().flatten()[:8].clone())
        return z

    monkeypatch.setattr(noise_module.NoiseSource, "normal", recording)
    first, _ = _fit(DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0, seed=5), steps=3)
    first.save_checkpoint(tmp_path / "ckpt")
    n_first = len(draws)
    resumed, model = _fit(DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0, seed=5), steps=6,
                          ckpt_path=tmp_path / "ckpt")
    assert resumed.global_step == 6 and len(draws) > n_first
    before, after = draws[:n_first], draws[n_first:]
    repeats = [(i, j) for i, a in enumerate(after) for j, b in enumerate(before) if torch.equal(a, b)]
    assert not repeats, f"resumed draws {[i for i, _ in repeats]} repeat earlier draws {[j for _, j in repeats]}"


class NoiseOnly(Net):
    """A zero loss: every update is lr × the released noise, so two updates' correlation is their noise's."""

    def training_step(self, batch, _):
        x, y, idx = batch
        self.seen.append(idx.tolist())
        return (self.body(x) * 0.0).sum() / max(len(x), 1)


@pytest.mark.parametrize("bound", ["max_epochs", "max_steps"])
def test_a_second_fit_of_the_same_trainer_draws_fresh_noise_and_batches(noise_draws, bound):
    """Fit, raise the bound, fit again: the ledger continues (3 -> 6 steps) and the second fit's streams follow the
    ledger's position, so it replays neither the first fit's noise (the difference of two released updates would
    cancel it) nor its Poisson batches."""
    draws = noise_draws
    L.seed_everything(0, verbose=False)
    model = NoiseOnly()
    limits = dict(max_epochs=1, limit_train_batches=3) if bound == "max_epochs" else dict(max_steps=3)
    strategy = DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0, seed=5)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[PrivacyAccountantCallback()],
                        **limits)
    p0 = _params(model)
    trainer.fit(model)
    p1, n_first, seen_first = _params(model), len(draws), list(model.seen)
    if bound == "max_epochs":
        trainer.fit_loop.max_epochs = 2
    else:
        trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(model)
    p2 = _params(model)
    assert strategy.ledger.steps == trainer.global_step == 6 and n_first == len(draws) - n_first > 0
    before, after = draws[:n_first], draws[n_first:]
    assert not [(i, j) for i, a in enumerate(after) for j, b in enumerate(before) if torch.equal(a, b)]
    first, second = p1 - p0, p2 - p1
    corr = float(torch.corrcoef(torch.stack([first, second]))[0, 1])
    assert abs(corr) < 0.5, f"the two fits' noise-only updates correlate: {corr:.3f}"  # 99 coordinates: sd ~0.1
    assert model.seen[len(seen_first):] != seen_first


def test_an_explicit_seed_warns_that_it_reproduces_the_noise():
    with pytest.warns(UserWarning, match="explicit seed reproduces the noise.*secure_mode=True"):
        _fit(DPDeepSpeedStrategy(stage=0, noise_multiplier=1.0, seed=5), steps=1)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(DPDeepSpeedStrategy(stage=0, noise_multiplier=1.0), steps=1)
        _fit(DPDeepSpeedStrategy(stage=0, noise_multiplier=1.0, seed=5, secure_mode=True), steps=1)
    assert not [w for w in caught if "explicit seed" in str(w.message)]


# ----------------------------------------------------------------------------------------------- loaders
class _Payload:
    """Unpickling this creates a file: proof that code ran while loading."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_that_would_run_code_is_refused_unloaded(tmp_path):
    trainer, _ = _fit(DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), steps=2)
    ckpt = tmp_path / "ckpt"
    trainer.save_checkpoint(ckpt)
    sentinel = tmp_path / "code_ran"
    shard = next((ckpt / "checkpoint").glob("*optim_states.pt"))
    state = torch.load(shard, weights_only=False)
    state["payload"] = _Payload(str(sentinel))
    torch.save(state, shard)
    # an attacker who can write the files can also rewrite the commit marker: the hashes match again
    commit = json.loads((ckpt / "privacy_commit.json").read_text())
    from lightning_dpzero.checkpoints.commit import file_digest as _file_digest

    commit["files"][shard.relative_to(ckpt).as_posix()] = _file_digest(shard)
    (ckpt / "privacy_commit.json").write_text(json.dumps(commit))
    assert not sentinel.exists()
    with pytest.raises(UnsafeCheckpointError, match=r"(io|builtins)\.open.*Nothing was unpickled"):
        _fit(DPDeepSpeedStrategy(stage=2, noise_multiplier=1.0), steps=4, ckpt_path=ckpt)
    assert not sentinel.exists(), "loading the checkpoint ran code from it"


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _name(func):
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def _enclosing_functions(tree):
    out = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                out.setdefault(id(node), []).append(fn.name)
    return out


# torch.load without weights_only=True, each reviewed: behind an explicit user opt-in (the CLI's
# --trust-checkpoint, export's trust_file=True), or reading back the file the exporter itself just wrote
REVIEWED_UNSAFE_LOADS = {("reader.py", "read_client_state"), ("export.py", "convert_zero_checkpoint_with_ledger")}


def test_package_loads_only_with_safe_loaders():
    """Every torch.load in the package passes weights_only=True (or is a reviewed, user-opted-in exception);
    no pickle/marshal/yaml.load/eval/exec/numpy allow_pickle anywhere. Ledgers and markers are JSON."""
    problems = []
    for f in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(f.read_text(), filename=str(f))
        owners = _enclosing_functions(tree)
        for call in _calls(tree):
            name = _name(call.func)
            kw = {k.arg: k.value for k in call.keywords}
            where = f"{f.relative_to(PACKAGE)}:{call.lineno} {name}"
            if name.endswith("torch.load") or name == "load" and "weights_only" in kw:
                value = kw.get("weights_only")
                if isinstance(value, ast.Constant) and value.value is True:
                    continue
                if any((f.name, fn) in REVIEWED_UNSAFE_LOADS for fn in owners.get(id(call), [])):
                    continue
                problems.append(f"{where}: weights_only is not True")
            elif name in ("pickle.load", "pickle.loads", "marshal.load", "marshal.loads", "eval", "exec",
                          "dill.load", "dill.loads", "cloudpickle.load", "cloudpickle.loads"):
                problems.append(where)
            elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                problems.append(where)
            elif name.endswith(("np.load", "numpy.load")) and isinstance(kw.get("allow_pickle"), ast.Constant) \
                    and kw["allow_pickle"].value:
                problems.append(where)
    assert not problems, problems
