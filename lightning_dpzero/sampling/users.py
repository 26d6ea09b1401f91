"""User-level sampling: Poisson sampling over users, each sampled user contributing up to k of its rows
(docs/how-to/user-level-dp.md; Charles et al., "Fine-tuning large language models with user-level differential
privacy", SaTML 2025, *user-level sampling*).

With ``privacy_unit="user"`` the unit that DP protects is a user: every row of the training set belongs to one
user (the dataset's ``user_ids``), and at each optimizer step every user is included independently with
probability q = B·W·K / U (B users per micro-batch, W ranks, K accumulation steps, U users). An included user
contributes min(k, n_u) of its rows, drawn uniformly without replacement, all in one micro-batch of one rank: the
per-example engine then clips the mean of those rows' gradients as one unit (``per_sample/units.py``), so adding
or removing a user changes the sum of clipped gradients by at most C, and the accountant's Poisson-subsampled
Gaussian at rate q over U users bounds the privacy loss of a user.

Users are sharded over ranks (rank r owns users r, r+W, ...), never split: a user's rows are in one micro-batch.
"""

from __future__ import annotations

import collections
from typing import Any, Iterator, Optional, Sequence

import numpy as np
from torch.utils.data import DataLoader, Subset

from ..util.options import PrivacyUnit, check_number, check_option
from .loader import loader_with_sampler
from .samplers import _check_int, _PoissonSizes, _secure_uniform, _ShardedBatchSampler, random_subset


def check_privacy_unit(privacy_unit: Any, max_examples_per_user: Any) -> tuple[str, Optional[int]]:
    """``(privacy_unit, k)`` checked: ``"example"`` (k must be None) or ``"user"`` (k an integer >= 1)."""
    unit = check_option("privacy_unit", privacy_unit, PrivacyUnit)
    if unit == "example":
        if max_examples_per_user is not None:
            raise ValueError("max_examples_per_user applies to privacy_unit='user' only. Fix: set privacy_unit='user' "
                             "(and give the dataset user_ids), or drop max_examples_per_user.")
        return unit, None
    k = check_number("max_examples_per_user", max_examples_per_user, integer=True, minimum=1,
                     hint="With privacy_unit='user' it is k, the most rows one user contributes to a step.")
    return unit, int(k)


def unit_text(unit: Optional[dict]) -> str:
    """A ledger's or plan's privacy unit as messages name it."""
    return "'example'" if unit is None else f"'user' with max_examples_per_user={unit['max_examples_per_user']}"


def user_codes(dataset: Any) -> np.ndarray:
    """Each row's user as an integer code ``(N,)`` in ``[0, U)``, from the dataset's ``user_ids`` (one hashable per
    index); a ``torch.utils.data.Subset`` maps its indices through its dataset's ``user_ids``.

    Raises:
        ValueError: no ``user_ids``, or not one per index.
    """
    ids = getattr(dataset, "user_ids", None)
    if ids is None and isinstance(dataset, Subset):
        parent = getattr(dataset.dataset, "user_ids", None)
        if parent is not None:
            ids = [parent[int(i)] for i in dataset.indices]
    if ids is None:
        raise ValueError(
            f"privacy_unit='user' needs each training row's user: {type(dataset).__name__} has no `user_ids`. Fix: give "
            "the training dataset an attribute `user_ids`, a sequence with one hashable id (patient, user, customer) "
            "per index, e.g. `self.user_ids = [note.patient_id for note in notes]`.")
    ids = list(ids)
    if len(ids) != len(dataset):
        raise ValueError(f"The training dataset's `user_ids` holds {len(ids)} ids for {len(dataset)} rows. Fix: one "
                         "user id per index of the dataset.")
    codes: dict = {}
    return np.array([codes.setdefault(u, len(codes)) for u in ids], dtype=np.int64)


class UserPoissonBatchSampler(_PoissonSizes, _ShardedBatchSampler):
    """Poisson sampling over users for user-level DP, sharded over ranks by user.

    Args:
        users: ``(N,)`` integer codes in ``[0, U)``, row i's user (:func:`user_codes`).
        sample_rate: q in (0, 1], each user's inclusion probability per optimizer step.
        max_examples_per_user: k >= 1: an included user contributes min(k, n_u) of its rows, drawn uniformly
            without replacement.
        num_replicas, rank, accumulate_grad_batches, steps_per_epoch, seed, secure_mode: as for
            :class:`~lightning_dpzero.sampling.DistributedPoissonBatchSampler` (``steps_per_epoch`` default
            max(1, round(1/q))); rank r owns users r, r+W, r+2W, ...

    Yields ``steps_per_epoch·K`` lists of row indices per epoch on every rank (empty ones included); the included
    users of a step are split over its K micro-batches, a user's rows together. :meth:`pop_units` gives, in the
    order the lists were yielded, each row's user within its micro-batch (0, 1, ...), for
    ``PerSampleEngine.start_micro_batch(units=...)``. ``num_samples`` is U and ``expected_batch_size`` q·U: the
    plan and the ledger count users.

    Example:
        >>> sampler = UserPoissonBatchSampler(np.array([0, 0, 0, 1, 2, 2]), sample_rate=1.0,
        ...                                   max_examples_per_user=2, seed=0)
        >>> batch = next(iter(sampler))
        >>> len(batch), sampler.pop_units().tolist()  # user 0 gives 2 of its 3 rows
        (5, [0, 0, 1, 2, 2])
    """

    sampler_kind = "poisson"

    def __init__(self, users: np.ndarray, sample_rate: float, max_examples_per_user: int, num_replicas: int = 1,
                 rank: int = 0, accumulate_grad_batches: int = 1, steps_per_epoch: Optional[int] = None,
                 seed: int = 0, secure_mode: bool = False) -> None:
        users = np.asarray(users, dtype=np.int64)
        num_users = int(users.max()) + 1 if users.size else 0
        super().__init__(num_users, num_replicas, rank, accumulate_grad_batches, seed, secure_mode)
        self.k = _check_int("max_examples_per_user", max_examples_per_user, 1,
                            "It is k, the most rows one user contributes to a step.")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
            raise ValueError(f"`sample_rate` must be in (0, 1], got {sample_rate!r}. It is q = B·W·K / U (B users per "
                             "micro-batch): use a smaller batch size or fewer devices/accumulation steps.")
        self.sample_rate = float(sample_rate)
        self.steps_per_epoch = _check_int("steps_per_epoch", steps_per_epoch or max(1, round(1 / self.sample_rate)),
                                          1, "Leave it None for round(1/q).")
        order = np.argsort(users, kind="stable")
        self._rows = np.split(order, np.cumsum(np.bincount(users, minlength=num_users))[:-1])  # rows of each user
        self.privacy_unit = {"unit": "user", "max_examples_per_user": self.k}
        self._units: collections.deque = collections.deque()

    def pop_units(self) -> np.ndarray:
        """The user of each row of the oldest micro-batch yielded and not yet popped, numbered 0, 1, ... within it.

        Raises:
            RuntimeError: no micro-batch is waiting (the training loop ran a batch this sampler did not draw).
        """
        if not self._units:
            raise RuntimeError("privacy_unit='user': a training micro-batch arrived that the user-level sampler did "
                               "not draw, so its rows' users are unknown. Train on the loader the strategy builds.")
        return self._units.popleft()

    def __iter__(self) -> Iterator[list[int]]:
        self._units.clear()  # an epoch cut short (limit_train_batches, a stop) leaves no stale units
        gen = None if self.secure_mode else self._generator()
        mine = self.shard  # this rank's users
        for _ in range(self.steps_per_epoch):
            uniforms = _secure_uniform(len(mine)) if gen is None else gen.random(len(mine))
            chosen = [self._contribution(int(u), gen) for u in mine[uniforms < self.sample_rate]]
            for part in np.array_split(np.arange(len(chosen)), self.accumulate_grad_batches):
                rows = [chosen[j] for j in part]
                self._units.append(np.repeat(np.arange(len(rows)), [len(r) for r in rows]))
                yield [int(i) for r in rows for i in r]

    def _contribution(self, user: int, gen: Optional[np.random.Generator]) -> np.ndarray:
        """min(k, n_u) of the user's rows, uniformly without replacement, in index order."""
        rows = self._rows[user]
        return rows if len(rows) <= self.k else rows[random_subset(len(rows), self.k, gen)]  # rows are in index order


def user_level_loader(dataloader: DataLoader, collectives: Any, accumulate_grad_batches: int, *, pre_sharded: bool,
                      poisson: bool, seed: int, secure_mode: bool, max_micro_batch_size: Optional[int],
                      max_examples_per_user: int, batch_sizes: Sequence[int]) -> DataLoader:
    """The training loader of a user-level run: the user's loader over the same dataset with a
    :class:`UserPoissonBatchSampler` at q = ΣB_r·K / U (``batch_sizes``: each rank's users per micro-batch).

    Raises:
        ValueError: a setting user-level sampling does not cover (fixed-size batches, pre-sharded data, a
            micro-batch bound), no or bad ``user_ids``, or q > 1.
    """
    for bad, why in ((not poisson, "poisson_sampling=False (fixed-size batches of rows cannot keep a user's rows "
                                   "together at a known rate)"),
                     (pre_sharded, "use_distributed_sampler=False (users are sharded over ranks by the sampler)"),
                     (max_micro_batch_size is not None, "max_micro_batch_size (its bound counts rows, not users)")):
        if bad:
            raise ValueError(f"privacy_unit='user' does not support {why}. Fix: remove that setting.")
    users = user_codes(dataloader.dataset)
    num_users = int(users.max()) + 1
    q = sum(batch_sizes) * accumulate_grad_batches / num_users
    if q > 1:
        raise ValueError(f"q = users per micro-batch × devices × accumulate_grad_batches / users = {sum(batch_sizes)} × "
                         f"{accumulate_grad_batches} / {num_users} = {q:.3g} > 1. Fix: a smaller DataLoader batch_size "
                         "(it counts users), fewer devices or accumulation steps.")
    sampler = UserPoissonBatchSampler(users, q, max_examples_per_user, collectives.world_size,
                                      collectives.global_rank, accumulate_grad_batches, seed=seed,
                                      secure_mode=secure_mode)
    return loader_with_sampler(dataloader, sampler)
