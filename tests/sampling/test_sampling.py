"""Tests for lightning_dpzero.sampling: Poisson sampling statistics, sharding, equal lengths, collate, loaders."""
from __future__ import annotations

import warnings
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from lightning_dpzero.sampling import (DistributedPoissonBatchSampler, DistributedShuffledBatchSampler,
                                       dataset_size, empty_safe_collate, poisson_sample_rate,
                                       private_dataloader)


def steps(sampler):
    """Group the yielded micro-batches into optimizer steps (K consecutive lists each)."""
    batches = list(sampler)
    k = sampler.accumulate_grad_batches
    return [batches[i:i + k] for i in range(0, len(batches), k)]


@pytest.mark.parametrize("secure", [False, True])
def test_inclusion_frequency_is_q(secure):
    n, w, q, t = 200, 2, 0.1, 2000
    counts = np.zeros(n)
    for r in range(w):
        s = DistributedPoissonBatchSampler(n, q, w, r, steps_per_epoch=t, seed=3, secure_mode=secure)
        for b in s:
            np.add.at(counts, b, 1)
    freq = counts / t
    # total ~ Binomial(n t, q): sd / mean = 0.5%; a factor-2 slip (q/2, 2q, or q/W) is off by 50%+.
    assert abs(freq.mean() - q) < 0.004
    # each example ~ Binomial(2000, 0.1) / 2000: sd 0.0067; +-0.04 is 6 sd
    assert np.all(np.abs(freq - q) < 0.04)


def test_batch_size_mean_and_variance_per_rank():
    n, w, q, t = 1000, 4, 0.05, 4000
    per_rank = n / w
    for r in (0, 3):
        sizes = np.array([len(b) for b in DistributedPoissonBatchSampler(n, q, w, r, steps_per_epoch=t, seed=r)])
        assert abs(sizes.mean() - q * per_rank) < 0.3              # 12.5, se 0.054
        assert abs(sizes.var() - per_rank * q * (1 - q)) < 1.5      # 11.875, se ~0.27; x2 or /2 fails
    s = DistributedPoissonBatchSampler(n, q, w, 0)
    assert s.expected_batch_size == pytest.approx(q * n) and s.sampler_kind == "poisson"
    assert len(s) == 20 and s.batch_size == 12  # round(1/q) steps; nominal micro-batch round(12.5)


@pytest.mark.parametrize("n,w", [(10, 3), (101, 4), (5, 8)])
def test_shards_disjoint_and_covering(n, w):
    seen = []
    for r in range(w):
        (full,) = list(DistributedPoissonBatchSampler(n, 1.0, w, r))  # q = 1: the whole shard
        assert all(i % w == r for i in full)
        seen += full
    assert sorted(seen) == list(range(n))
    for r in range(w):
        for b in DistributedPoissonBatchSampler(n, 0.3, w, r, steps_per_epoch=20, seed=1):
            assert all(i % w == r for i in b)


@pytest.mark.parametrize("k", [1, 3])
def test_same_length_on_all_ranks_with_tiny_q(k):
    n, w, q = 10, 4, 0.01  # ranks own 3, 3, 2, 2 examples; most batches are empty
    lengths, empties = set(), 0
    for r in range(w):
        for epoch in range(2):
            s = DistributedPoissonBatchSampler(n, q, w, r, accumulate_grad_batches=k, seed=0)
            s.set_epoch(epoch)
            batches = list(s)
            lengths.add(len(batches))
            assert len(s) == len(batches)
            empties += sum(len(b) == 0 for b in batches)
    assert lengths == {100 * k} and empties > 0.9 * 8 * 100 * k


def test_accumulation_splits_the_step_sample():
    n, w, q, k = 300, 2, 0.2, 3
    for r in range(w):
        whole = steps(DistributedPoissonBatchSampler(n, q, w, r, steps_per_epoch=50, seed=7))
        split = steps(DistributedPoissonBatchSampler(n, q, w, r, accumulate_grad_batches=k, steps_per_epoch=50,
                                                     seed=7))
        assert len(split) == 50 and all(len(s) == k for s in split)
        for (step,), micro in zip(whole, split):
            union = [i for b in micro for i in b]
            assert union == step and len(set(union)) == len(union)
            sizes = [len(b) for b in micro]
            assert max(sizes) - min(sizes) <= 1


def test_reproducible_with_seed_and_fresh_across_epochs():
    make = lambda seed=5: DistributedPoissonBatchSampler(500, 0.1, 2, 1, seed=seed)  # noqa: E731
    a, b = make(), make()
    first = list(a)
    assert first == list(b)
    assert list(a) != first  # a second pass without set_epoch is a fresh draw, not a replay
    a.set_epoch(0)
    assert list(a) == first
    a.set_epoch(1)
    assert list(a) != first
    assert list(make(seed=6)) != first
    other_rank = DistributedPoissonBatchSampler(500, 0.1, 2, 0, seed=5)
    assert [len(x) for x in other_rank] != [len(x) for x in first]


def test_secure_mode_not_reproducible():
    a = DistributedPoissonBatchSampler(1000, 0.5, secure_mode=True, seed=0)
    b = DistributedPoissonBatchSampler(1000, 0.5, secure_mode=True, seed=0)
    assert list(a) != list(b)
    a.set_epoch(0)
    assert list(a) != list(b)


def test_lightning_set_epoch_reaches_sampler():
    from lightning.fabric.utilities.data import _set_sampler_epoch

    dl = private_dataloader(DataLoader(TensorDataset(torch.zeros(20, 2))), 0.2, 1, 0)
    _set_sampler_epoch(dl, 4)
    assert dl.batch_sampler.epoch == 4


@pytest.mark.parametrize("kwargs,name", [
    (dict(num_samples=0, sample_rate=0.1), "num_samples"),
    (dict(num_samples=10, sample_rate=0.0), "sample_rate"),
    (dict(num_samples=10, sample_rate=1.5), "sample_rate"),
    (dict(num_samples=10, sample_rate=float("nan")), "sample_rate"),
    (dict(num_samples=10, sample_rate=0.1, num_replicas=2, rank=2), "rank"),
    (dict(num_samples=10, sample_rate=0.1, rank=-1), "rank"),
    (dict(num_samples=10, sample_rate=0.1, accumulate_grad_batches=0), "accumulate_grad_batches"),
    (dict(num_samples=10, sample_rate=0.1, steps_per_epoch=0), "steps_per_epoch"),
])
def test_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DistributedPoissonBatchSampler(**kwargs)


def test_sample_rate_and_q_above_one_refused():
    assert poisson_sample_rate(8, 2, 4, 640) == pytest.approx(0.1)
    with pytest.raises(ValueError, match=r"batch_size 8 x devices 2 x accumulate_grad_batches 4 / dataset size 60"):
        poisson_sample_rate(8, 2, 4, 60)
    with pytest.raises(ValueError, match="batch_size"):
        poisson_sample_rate(0, 1, 1, 10)


Point = namedtuple("Point", ["x", "label"])


class DictDataset(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"x": torch.full((3, 4), float(i), dtype=torch.float64), "y": i, "p": Point(torch.ones(2), "a")}


def test_empty_safe_collate_shapes():
    ds = TensorDataset(torch.randn(10, 3, 4), torch.arange(10))
    collate = empty_safe_collate(None, ds)
    x, y = collate([])
    assert x.shape == (0, 3, 4) and x.dtype == torch.float32 and y.shape == (0,) and y.dtype == torch.int64
    x, y = collate([ds[0], ds[1]])
    assert x.shape == (2, 3, 4)
    assert empty_safe_collate(collate, ds) is collate
    batch = empty_safe_collate(None, DictDataset())([])
    assert batch["x"].shape == (0, 3, 4) and batch["x"].dtype == torch.float64
    assert batch["y"].shape == (0,)
    assert isinstance(batch["p"], Point) and batch["p"].x.shape == (0, 2) and len(batch["p"].label) == 0
    with pytest.raises(IndexError):  # the reason the wrapper exists
        torch.utils.data.default_collate([])


class WorkerOnlyDataset(TensorDataset):
    """Readable in DataLoader workers only (as a dataset that opens its files in ``worker_init_fn``)."""

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is None:
            raise RuntimeError("open the files first")
        return super().__getitem__(i)


def test_the_stand_in_of_an_empty_batch_is_the_first_example_as_a_batch_of_one():
    from torch.utils.data import DataLoader

    from lightning_dpzero.sampling.collate import stand_in_batch

    ds = DictDataset()
    batch = stand_in_batch(DataLoader(ds, batch_size=2, collate_fn=empty_safe_collate(None, ds)))
    assert batch["x"].shape == (1, 3, 4) and batch["y"].tolist() == [0] and list(batch["p"].label) == ["a"]
    assert stand_in_batch(DataLoader(ds, batch_size=2)) is None  # not the private loader's collate
    ds = WorkerOnlyDataset(torch.randn(4, 2))
    loader = DataLoader(ds, batch_size=2, collate_fn=empty_safe_collate(None, ds))
    with pytest.warns(UserWarning, match=r"runs on its zero rows.*RuntimeError: open the files first"):
        assert stand_in_batch(loader) is None  # the empty batch then runs on its zero rows, as before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert stand_in_batch(loader) is None  # warned once


def _worker_init(worker_id):  # module level: picklable
    torch.manual_seed(worker_id)


@pytest.mark.parametrize("workers", [0, 2])
def test_private_dataloader_iterates_with_empty_batches(workers):
    ds = TensorDataset(torch.randn(40, 5), torch.arange(40))
    user = DataLoader(ds, batch_size=4, shuffle=True, num_workers=workers, worker_init_fn=_worker_init,
                      persistent_workers=workers > 0)
    for rank in range(2):
        dl = private_dataloader(user, 0.02, 2, rank, accumulate_grad_batches=2, seed=1)
        s = dl.batch_sampler
        assert s.sampler_kind == "poisson" and s.expected_batch_size == pytest.approx(0.8)
        assert dl.num_workers == workers and dl.worker_init_fn is _worker_init
        assert dl.persistent_workers == (workers > 0)
        batches = list(dl)
        assert len(batches) == len(dl) == 100
        assert any(len(y) == 0 for _, y in batches) and any(len(y) > 0 for _, y in batches)
        for x, y in batches:
            assert x.shape == (len(y), 5) and torch.all(y % 2 == rank)


def test_private_dataloader_dict_dataset():
    dl = private_dataloader(DataLoader(DictDataset()), 0.05, 1, 0, seed=0)
    sizes = [b["x"].shape for b in dl]
    assert (0, 3, 4) in sizes and len(sizes) == 20


def test_shuffle_mode():
    n, w, b, k = 103, 2, 4, 3
    user = DataLoader(TensorDataset(torch.arange(n)), batch_size=b)
    q = poisson_sample_rate(b, w, k, n)
    per_rank = []
    for r in range(w):
        dl = private_dataloader(user, q, w, r, accumulate_grad_batches=k, poisson=False, seed=2)
        s = dl.batch_sampler
        assert isinstance(s, DistributedShuffledBatchSampler) and s.sampler_kind == "shuffle"
        assert s.expected_batch_size == b * w * k and s.sample_rate == pytest.approx(q)
        batches = [t.tolist() for (t,) in dl]
        assert len(batches) == len(dl) == 4 * k and all(len(x) == b for x in batches)  # 51 // 12 = 4 steps
        flat = [i for x in batches for i in x]
        assert len(set(flat)) == len(flat)
        per_rank.append(set(flat))
        s.set_epoch(1)
        assert [t.tolist() for (t,) in dl] != batches
    assert not per_rank[0] & per_rank[1]
    with pytest.raises(ValueError, match="sample_rate"):
        private_dataloader(user, 0.5, w, 0, poisson=False)
    with pytest.raises(ValueError, match="batch_size"):
        DistributedShuffledBatchSampler(10, 4, 2, 0, accumulate_grad_batches=2)


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


class NoLen(Dataset):
    def __getitem__(self, i):
        return i


def test_dataset_size_refusals():
    assert dataset_size(DataLoader(TensorDataset(torch.zeros(7)))) == 7
    with pytest.raises(TypeError, match="IterableDataset"):
        dataset_size(DataLoader(Stream()))
    with pytest.raises(TypeError, match="size N"):
        dataset_size(DataLoader(NoLen()))
    with pytest.raises(TypeError, match="IterableDataset"):
        private_dataloader(DataLoader(Stream()), 0.1, 1, 0)


# ------------------------------------------------------------------------------------------ explicit batch_sampler
def _fit_tiny(loader_fn, strategy_kw=None, **trainer_kw):
    """Fit a tiny model for 2 steps on CPU with the DP strategy; returns (strategy, micro-batches run)."""
    import lightning as L
    from tiny_module import Net  # a small module counting its micro-batches

    from lightning_dpzero import DPDeepSpeedStrategy

    class Tiny(Net):
        def train_dataloader(self):
            return loader_fn(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))))

    model = Tiny()
    strategy = DPDeepSpeedStrategy(**{"stage": 2, "noise_multiplier": 1.0, **(strategy_kw or {})})
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_steps=2, **trainer_kw)
    trainer.fit(model)
    return strategy, model.micro_batches


def _batch_sampler_loader(ds):
    from torch.utils.data import BatchSampler, SequentialSampler

    return DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 8, False))


def test_explicit_batch_sampler_refused_naming_the_fix():
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

    from lightning_dpzero.sampling import check_sampler_describable

    ds = TensorDataset(torch.zeros(32, 2))
    for inner in (SequentialSampler(ds), RandomSampler(ds)):
        with pytest.raises(ValueError, match=r"batch_sampler=BatchSampler\(sampler, batch_size=8.*None.*"
                                             r"Remove batch_sampler=.*batch_size=8.*privacy ledger"):
            check_sampler_describable(DataLoader(ds, batch_sampler=BatchSampler(inner, 8, False)))
    # the same batches asked for the ordinary way are accepted
    check_sampler_describable(DataLoader(ds, batch_size=8))
    check_sampler_describable(DataLoader(ds, batch_size=8, shuffle=True))


def test_explicit_batch_sampler_refused_before_training():
    """Without Lightning's sampler injection the strategy sees the user's loader: refused before any step."""
    with pytest.raises(ValueError, match=r"batch_sampler=BatchSampler.*batch_size=8"):
        _fit_tiny(_batch_sampler_loader, use_distributed_sampler=False)


def test_explicit_batch_sampler_dropped_by_lightnings_sampler_injection_is_warned_about(recwarn):
    # Lightning rebuilds the loader as DataLoader(batch_size=1) before the strategy sees it: nothing is left to
    # refuse (q is right for what runs), so the strategy warns with the fix.
    strategy, _ = _fit_tiny(_batch_sampler_loader)
    assert strategy.plan.expected_batch_size == 1
    assert any("batch_sampler=BatchSampler" in str(w.message) and "batch_size=B" in str(w.message) for w in recwarn)


@pytest.mark.parametrize("trainer_kw", [{}, {"use_distributed_sampler": False}])
def test_plain_shuffled_loader_trains_with_its_batch_size(trainer_kw):
    strategy, micro = _fit_tiny(lambda ds: DataLoader(ds, batch_size=8, shuffle=True), **trainer_kw)
    assert micro == 2 and strategy.plan.sample_rate == 8 / 64 and strategy.plan.expected_batch_size == 8


# ------------------------------------------------------------------------------------------ shuffle accounting warning
def _shuffle_warnings(record):
    return [w for w in record if "assumes Poisson subsampling" in str(w.message)]


@pytest.mark.parametrize("sigma, warned", [(1.0, True), (0.0, False)])
def test_shuffled_batches_warn_that_epsilon_assumes_poisson(recwarn, sigma, warned):
    loader = lambda ds: DataLoader(ds, batch_size=8, shuffle=True)  # noqa: E731
    strategy, _ = _fit_tiny(loader, strategy_kw={"poisson_sampling": False, "noise_multiplier": sigma})
    assert strategy.plan.sampler_kind == "shuffle"
    found = _shuffle_warnings(recwarn)
    assert len(found) == (1 if warned else 0)
    if warned:
        assert "optimistic" in str(found[0].message) and "Chua et al. 2024" in str(found[0].message)


def test_poisson_batches_do_not_warn(recwarn):
    strategy, _ = _fit_tiny(lambda ds: DataLoader(ds, batch_size=8, shuffle=True))
    assert strategy.plan.sampler_kind == "poisson" and not _shuffle_warnings(recwarn)
