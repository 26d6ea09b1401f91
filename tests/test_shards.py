"""Pre-sharded training data (``Trainer(use_distributed_sampler=False)``, each rank's DataLoader over its own
shard): N is the sum of the shards, each shard is Poisson-sampled at the global q, the ledger records N and the
shards; every rank given the same global dataset is one dataset, never N counted W times (``shards.py``)."""

import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_dpzero import shards
from lightning_dpzero.accounting import PrivacyLedger
from lightning_dpzero.sampling import (DistributedPoissonBatchSampler, DistributedShuffledBatchSampler,
                                       private_dataloader)
from lightning_dpzero.shards import dataset_digest, describe_training_data


# --------------------------------------------------------------------------------------- samplers over shards
def test_poisson_over_unequal_shards_samples_each_shard_at_the_global_q():
    sizes, q, steps = (300, 700), 0.05, 4000
    counts, lengths = [], set()
    for rank in range(2):
        s = DistributedPoissonBatchSampler(1000, q, num_replicas=2, rank=rank, shard_sizes=sizes,
                                           steps_per_epoch=steps, seed=3)
        batches = list(s)
        lengths.add(len(batches))
        flat = np.concatenate([b for b in batches if b])
        assert flat.min() >= 0 and flat.max() < sizes[rank]  # indices into this rank's own dataset
        counts.append(np.bincount(flat, minlength=sizes[rank]))
        mean = np.mean([len(b) for b in batches])
        # q·n_r per step; a q computed against one shard (N = 300 or 700) or against W·N is off by far more
        assert mean == pytest.approx(q * sizes[rank], rel=4 * math.sqrt((1 - q) / (q * sizes[rank] * steps)))
    assert lengths == {steps}  # every rank runs the same number of steps
    per_example = np.concatenate(counts) / steps  # every example of the union joins at rate q
    assert per_example.mean() == pytest.approx(q, rel=0.01)
    assert abs(per_example - q).max() < 6 * math.sqrt(q * (1 - q) / steps)


def test_shuffled_over_unequal_shards_runs_the_smallest_shards_steps():
    for rank in range(2):
        s = DistributedShuffledBatchSampler(64, 4, num_replicas=2, rank=rank, shard_sizes=(24, 40))
        batches = list(s)
        assert len(batches) == 6 and {len(b) for b in batches} == {4}
        assert s.sample_rate == 8 / 64 and s.expected_batch_size == 8
        assert max(max(b) for b in batches) < (24, 40)[rank]


@pytest.mark.parametrize("n, sizes", [(21, (10, 10)), (15, (5, 5, 5)), (10, (10, 0))])
def test_bad_shard_sizes_are_refused(n, sizes):  # not summing to N, not one per rank, an empty shard
    with pytest.raises(ValueError, match="shard_sizes"):
        DistributedPoissonBatchSampler(n, 0.1, num_replicas=2, rank=0, shard_sizes=sizes)


def test_private_dataloader_over_a_shard_takes_n_from_the_shards():
    loader = DataLoader(TensorDataset(torch.arange(30.0)), batch_size=2)
    private = private_dataloader(loader, 0.1, 2, 1, shard_sizes=(70, 30))
    assert private.batch_sampler.num_samples == 100 and private.batch_sampler.shard_sizes == (70, 30)


# --------------------------------------------------------------------------------------- the digest
class Augmented(torch.utils.data.Dataset):
    """Random augmentation from the global generators, as torchvision transforms do."""

    def __init__(self, n):
        self.x = torch.arange(float(n))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        import random

        return {"x": self.x[i] + torch.rand(()) + random.random() + float(np.random.rand()), "i": i}


def test_digest_is_by_value_and_sees_through_random_augmentation():
    a, b = Augmented(50), Augmented(50)
    torch.manual_seed(0)
    first = dataset_digest(a, 50)
    torch.manual_seed(1)
    assert dataset_digest(b, 50) == first  # the same data under other global random states
    state = torch.get_rng_state()
    dataset_digest(a, 50)
    assert torch.equal(torch.get_rng_state(), state)
    assert dataset_digest(TensorDataset(torch.arange(50.0) + 1), 50) != dataset_digest(
        TensorDataset(torch.arange(50.0)), 50)


# --------------------------------------------------------------------------------------- what the ranks hold
def _ranks_hold(monkeypatch, datasets, rank=0):
    """describe_training_data on ``rank`` with every rank's (length, digest) as if gathered."""
    found = []
    for d in datasets:
        n = len(d)
        found.append((n, dataset_digest(d, n), None))
    monkeypatch.setattr(shards, "gather_objects", lambda mine, world: found)
    loader = DataLoader(datasets[rank], batch_size=2)
    return describe_training_data(loader, len(datasets), pre_sharded=True)


def test_disjoint_shards_sum_to_n(monkeypatch):
    x = torch.arange(100.0)
    data = _ranks_hold(monkeypatch, [TensorDataset(x[:30]), TensorDataset(x[30:])])
    assert data.dataset_size == 100 and data.shard_sizes == (30, 70)


def test_the_same_dataset_on_every_rank_is_one_dataset_not_w(monkeypatch, caplog):
    """The example configs' case (use_distributed_sampler=False for validation): N once, said in the log only."""
    import logging
    import warnings

    x = torch.arange(100.0)
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("error")
        data = _ranks_hold(monkeypatch, [TensorDataset(x), TensorDataset(x.clone())])
    assert data.dataset_size == 100 and data.shard_sizes is None  # not 200
    assert "holds the same dataset" in caplog.text and "treated as one global dataset of N = 100" in caplog.text


def test_some_ranks_holding_the_same_dataset_is_refused(monkeypatch):
    x = torch.arange(100.0)
    with pytest.raises(ValueError, match="ranks 0, 2 hold the same dataset"):
        _ranks_hold(monkeypatch, [TensorDataset(x[:50]), TensorDataset(x[50:]), TensorDataset(x[:50])])


def test_default_path_takes_one_datasets_length():
    loader = DataLoader(TensorDataset(torch.arange(40.0)), batch_size=2)
    assert describe_training_data(loader, 4, pre_sharded=False).dataset_size == 40


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


def test_a_shard_without_length_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setattr(shards, "gather_objects", lambda mine, world: [mine, (10, "x", None)])
    with pytest.raises(TypeError, match="map-style Dataset of that rank's shard"):
        describe_training_data(DataLoader(Stream(), batch_size=1), 2, pre_sharded=True)


def test_a_peer_shard_refused_raises_on_every_rank(monkeypatch):
    monkeypatch.setattr(shards, "gather_objects",
                        lambda mine, world: [mine, (0, "", "ValueError: the training dataset is empty.")])
    with pytest.raises(ValueError, match="Rank 1's training DataLoader was refused"):
        describe_training_data(DataLoader(TensorDataset(torch.arange(5.0)), batch_size=1), 2, pre_sharded=True)


def test_shuffled_unequal_shards_warn_of_the_smallest_shards_rate():
    with pytest.warns(UserWarning, match="smallest shard"):
        shards.warn_unequal_shuffled_shards((24, 40), 4, 8 / 64)


# --------------------------------------------------------------------------------------- the ledger
def test_ledger_records_the_shards_and_old_ledgers_hash_as_before():
    plain = PrivacyLedger(1e-5, 100, run_id="r")
    plain.charge(0.1, 1.0, steps=3)
    assert "shard_sizes" not in plain.to_dict()  # an older ledger's document and hashes are unchanged
    assert PrivacyLedger.from_dict(plain.to_dict()) == plain
    sharded = PrivacyLedger(1e-5, 100, run_id="r", shard_sizes=(30, 70))
    sharded.charge(0.1, 1.0, steps=3)
    d = sharded.to_dict()
    assert d["shard_sizes"] == [30, 70] and d["head"] != plain.to_dict()["head"]
    assert PrivacyLedger.from_dict(d).shard_sizes == [30, 70]
    d["shard_sizes"] = [50, 50]  # an edit of the recorded sharding breaks the chain
    with pytest.raises(ValueError, match="hash chain"):
        PrivacyLedger.from_dict(d)
    with pytest.raises(ValueError, match="shard_sizes"):
        PrivacyLedger(1e-5, 100, shard_sizes=(30, 60))


# --------------------------------------------------------------------------------------- 2 processes
SHARD_BASE = dict(model="token", n=64, batch_size=4, lr=0.5, steps=6, sigma=0.0, C=0.3, clipping="all-layer",
                  clipping_fn="abadi", poisson=True, accumulate=2, stage=2, use_distributed_sampler=False,
                  max_epochs=-1)


def _shard_cases():
    return [
        # unequal shards (24 and 40 of the 64), Poisson: q = 4·2·2/64 = 0.25 against N = 64
        dict(SHARD_BASE, name="poisson_unequal", shards=[[0, 24], [24, 64]]),
        # fixed-size batches over the same shards: q = B·W·K/N = 0.125; 24 // 4 = 6 micro-batches per epoch
        dict(SHARD_BASE, name="shuffle_unequal", shards=[[0, 24], [24, 64]], poisson=False, accumulate=1,
             stage=3),
        # every rank given the whole data set with use_distributed_sampler=False: N = 64, not 128
        dict(SHARD_BASE, name="same_everywhere", shards=[[0, 64], [0, 64]], accumulate=1),
    ]


@pytest.fixture(scope="module")
def shard_runs(tmp_path_factory):
    from harness import run_cases

    cases = _shard_cases()
    return cases, run_cases(cases, tmp_path_factory.mktemp("shards"), 2)


def _examples_per_step(res):
    per_step = {}
    for seen in res["seen"]:
        for step, idx in seen:
            per_step[step] = per_step.get(step, 0) + len(idx)
    return per_step


def _matches_the_oracle(case, res):
    from harness import expected_params

    for k, v in expected_params(case, res).items():
        torch.testing.assert_close(res["final"][k], v, rtol=1e-5, atol=1e-6, msg=f"{case['name']} {k}")


@pytest.mark.slow
def test_unequal_poisson_shards_train_like_the_oracle_with_n_their_sum(shard_runs):
    cases, results = shard_runs
    case, res = cases[0], results["poisson_unequal"]
    assert res["plan"]["dataset_size"] == 64 and res["plan"]["sample_rate"] == pytest.approx(0.25)
    assert tuple(res["plan"]["shard_sizes"]) == (24, 40)
    assert res["ledger"]["dataset_size"] == 64 and res["ledger"]["shard_sizes"] == [24, 40]
    assert [e["sample_rate"] for e in res["ledger"]["entries"]] == [0.25]
    for rank, (start, stop) in enumerate(case["shards"]):
        assert all(start <= i < stop for _, idx in res["seen"][rank] for i in idx)  # each rank its own shard
    # 6 steps of q·N = 16 expected examples: 96 ± 10; N taken as one shard (q = 0.67 or 0.4) or as 2·64 (q =
    # 0.125) would draw about 4 standard deviations away or more
    total = sum(_examples_per_step(res).values())
    assert abs(total - 96) < 4 * math.sqrt(96 * 0.75), total
    _matches_the_oracle(case, res)


@pytest.mark.slow
def test_unequal_shuffled_shards_use_the_global_n(shard_runs):
    cases, results = shard_runs
    case, res = cases[1], results["shuffle_unequal"]
    assert res["plan"]["sampler_kind"] == "shuffle" and res["plan"]["dataset_size"] == 64
    assert res["plan"]["sample_rate"] == pytest.approx(0.125)
    assert res["ledger"]["shard_sizes"] == [24, 40]
    assert set(_examples_per_step(res).values()) == {8}  # B·W every step
    _matches_the_oracle(case, res)


@pytest.mark.slow
def test_the_same_global_dataset_on_every_rank_is_not_counted_twice(shard_runs):
    cases, results = shard_runs
    case, res = cases[2], results["same_everywhere"]
    assert res["plan"]["dataset_size"] == 64 and res["ledger"]["dataset_size"] == 64  # not 128
    assert res["plan"]["shard_sizes"] is None and "shard_sizes" not in res["ledger"]
    assert res["plan"]["sample_rate"] == pytest.approx(4 * 2 / 64)
    # sharded by the DP sampler as in the default path: no example on both ranks
    for rank in range(2):
        assert all(i % 2 == rank for _, idx in res["seen"][rank] for i in idx)
    _matches_the_oracle(case, res)
