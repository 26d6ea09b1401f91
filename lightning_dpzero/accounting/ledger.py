"""The privacy ledger: the source of truth for epsilon.

A ledger is an ordered list of runs of identical DP-SGD steps ``(q, sigma, steps, sampler)`` (with bounded
micro-batches also b, K and each rank's number of examples) plus fixed metadata (delta, dataset size N,
accountant, run id) and a SHA-256 hash chain over the entries and the metadata. Epsilon is always recomputed from the entries with dp-accounting
(see :mod:`lightning_dpzero.accounting.accountants`); it is never stored as a number to trust.

The hash chain is tamper-*evidence* against hand edits and corruption (a changed step count, sigma,
q, delta or N makes :meth:`PrivacyLedger.verify`, ``from_dict`` and ``load`` raise
:class:`LedgerIntegrityError`); it carries no secret, so it does not resist a deliberate forger who
recomputes the hashes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

from ..util.atomic import atomic_write_text
from .accountants import EpsilonBound, _check_accountant, _check_delta, epsilon_bound
from .banded import bands_of
from .blt import blt_of
from .truncation import MicroBatchBound, bound_fields

SAMPLERS = ("poisson", "shuffle")
FORMAT = "lightning_dpzero.privacy_ledger"
FORMAT_VERSION = 1
_GENESIS = "0" * 64
_DISTRIBUTIONS = {"lightning_dpzero": "lightning-dpzero", "torch": "torch", "deepspeed": "deepspeed",
                  "lightning": "lightning", "dp_accounting": "dp-accounting"}


class LedgerIntegrityError(ValueError):
    """A saved or in-memory ledger does not match its hash chain, or is malformed."""


@dataclass
class LedgerEntry:
    """One run of identical steps.

    Attributes:
        sample_rate: q in (0, 1], the probability that an example is in a step's batch
            (for ``sampler="shuffle"``, q = B/N of fixed-size shuffled batches, accounted *as if*
            Poisson: a common approximation, recorded so that it stays visible).
        noise_multiplier: sigma >= 0, noise std divided by the total clipping norm.
        steps: number of optimizer steps in this run, >= 1.
        sampler: ``"poisson"``, ``"shuffle"``, or ``"cyclic-poisson:<b>"`` (correlated noise, banded matrix
            factorization over b parts: q is the per-step rate over the whole set, and the accountant composes
            ``⌈steps/b⌉`` rounds at ``b·q``; :mod:`~lightning_dpzero.accounting.banded`).
        max_micro_batch_size, accumulate_grad_batches, rank_sizes: bounded micro-batches (b, K and the examples
            of each rank): a step sample above K·b on a rank was truncated to K·b, which the accounting charges
            in δ (docs/privacy.md, *Bounded micro-batches*). All None (the default) without a bound; None fields
            are left out of the hash and the JSON, so a ledger without bounds reads as before.

    Example:
        >>> LedgerEntry(sample_rate=0.01, noise_multiplier=1.1, steps=500)  # doctest: +ELLIPSIS
        LedgerEntry(sample_rate=0.01, noise_multiplier=1.1, steps=500, sampler='poisson', ...)
    """

    sample_rate: float
    noise_multiplier: float
    steps: int
    sampler: str = "poisson"
    max_micro_batch_size: Optional[int] = None
    accumulate_grad_batches: Optional[int] = None
    rank_sizes: Optional[tuple] = None

    def __post_init__(self):
        _validate(self.sample_rate, self.noise_multiplier, self.sampler, self.steps)
        self.sample_rate, self.noise_multiplier = float(self.sample_rate), float(self.noise_multiplier)
        self.steps = int(self.steps)
        fields = (self.max_micro_batch_size, self.accumulate_grad_batches, self.rank_sizes)
        if any(f is not None for f in fields):
            bound = MicroBatchBound(*fields)  # checks them
            self.max_micro_batch_size, self.accumulate_grad_batches = (bound.max_micro_batch_size,
                                                                       bound.accumulate_grad_batches)
            self.rank_sizes = bound.rank_sizes

    @property
    def micro_batch_bound(self) -> Optional[MicroBatchBound]:
        """The entry's :class:`~lightning_dpzero.accounting.truncation.MicroBatchBound`, or None."""
        if self.max_micro_batch_size is None:
            return None
        return MicroBatchBound(self.max_micro_batch_size, self.accumulate_grad_batches, self.rank_sizes)

    @classmethod
    def of(cls, sample_rate: float, noise_multiplier: float, steps: int, sampler: str = "poisson",
           bound: Optional[MicroBatchBound] = None) -> "LedgerEntry":
        """An entry with ``bound``'s fields (None: no bound)."""
        return cls(sample_rate, noise_multiplier, steps, sampler, *bound_fields(bound))

    def record(self) -> dict:
        """The fields as hashed and saved: those that are None left out (older ledgers hash as before)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v is not None}


def _validate(sample_rate, noise_multiplier, sampler, steps):
    if isinstance(sample_rate, bool) or not 0.0 < float(sample_rate) <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1] (expected batch size / dataset size), "
                         f"got {sample_rate!r}.")
    s = float(noise_multiplier)
    if not (s >= 0.0 and math.isfinite(s)):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}.")
    if sampler not in SAMPLERS and bands_of(sampler) is None and blt_of(sampler) is None:
        raise ValueError(f"sampler must be one of {SAMPLERS!r}, 'cyclic-poisson:<bands>' or 'cyclic-blt:...', got "
                         f"{sampler!r}.")
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}.")


def _library_versions() -> dict:
    out = {}
    for key, dist in _DISTRIBUTIONS.items():
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


class PrivacyLedger:
    """Ordered runs of (q, sigma, steps) + metadata + a hash chain. The source of truth for epsilon.

    Args:
        delta: target delta in (0, 1) for the reported epsilon.
        dataset_size: N, the number of training examples (q is a rate against N), >= 1.
        accountant: ``"pld"`` (default, tight) or ``"rdp"``.
        run_id: identifies the training run (a random uuid4 hex if None); resume refuses a ledger
            from another run (:meth:`same_run`).
        shard_sizes: pre-sharded data: the length of each rank's shard, in rank order, summing to
            ``dataset_size`` (hashed with the metadata); ``None`` (default): one dataset, sharded by the sampler.
            A ledger without it (older ones included) hashes exactly as before.
        privacy_unit: user-level DP, ``{"unit": "user", "max_examples_per_user": k}`` (hashed with the metadata;
            ``dataset_size`` then counts users and ε is per user); ``None`` (default): example-level.
        noise_mechanism: correlated noise (banded matrix factorization), ``{"mechanism": "banded-mf", "bands": b,
            "coefficients_digest": ..., "partition_seed": s}`` (hashed with the metadata; a resume with another
            mechanism, b or partition is refused); ``None`` (default): DP-SGD's independent noise.

    Attributes ``entries`` (list of :class:`LedgerEntry`), ``delta``, ``dataset_size``, ``shard_sizes``,
    ``accountant``, ``run_id`` and ``versions`` (installed versions of lightning_dpzero, torch,
    deepspeed, lightning, dp_accounting; missing ones absent; informational, not hashed).
    Raises ValueError on invalid arguments.

    Example:
        >>> ledger = PrivacyLedger(delta=1e-5, dataset_size=60_000)
        >>> ledger.charge(sample_rate=256 / 60_000, noise_multiplier=1.1, steps=700)
        >>> ledger.charge(sample_rate=256 / 60_000, noise_multiplier=1.1)  # merges into the same entry
        >>> ledger.steps, len(ledger.entries), round(ledger.epsilon(), 2)
        (701, 1, 0.5)
        >>> PrivacyLedger.from_json(ledger.to_json()) == ledger  # the hash chain is verified when read
        True
    """

    def __init__(self, delta: float, dataset_size: int, accountant: str = "pld",
                 run_id: str | None = None, shard_sizes: list[int] | tuple[int, ...] | None = None,
                 privacy_unit: dict | None = None, noise_mechanism: dict | None = None):
        self.delta = _check_delta(delta)
        if isinstance(dataset_size, bool) or int(dataset_size) != dataset_size or dataset_size < 1:
            raise ValueError(f"dataset_size must be an integer >= 1, got {dataset_size!r}.")
        self.dataset_size = int(dataset_size)
        if shard_sizes is not None:
            shard_sizes = [int(n) for n in shard_sizes]
            if not shard_sizes or min(shard_sizes) < 1 or sum(shard_sizes) != self.dataset_size:
                raise ValueError(f"shard_sizes must be sizes >= 1 summing to dataset_size={self.dataset_size}, "
                                 f"got {shard_sizes!r}.")
        self.shard_sizes = shard_sizes
        # user-level DP: {"unit": "user", "max_examples_per_user": k}; dataset_size then counts users (hashed)
        self.privacy_unit = None if privacy_unit is None else {"unit": str(privacy_unit["unit"]),
                                                               "max_examples_per_user":
                                                                   int(privacy_unit["max_examples_per_user"])}
        # correlated noise: {"mechanism": "banded-mf", "bands": b, "coefficients_digest", "partition_seed"} (hashed)
        self.noise_mechanism = None if noise_mechanism is None else dict(noise_mechanism)
        self.accountant = _check_accountant(accountant)
        self.run_id = uuid.uuid4().hex if run_id is None else str(run_id)
        self.versions = _library_versions()
        self.entries: list[LedgerEntry] = []
        self._hashes: list[str] = []

    # ----------------------------------------------------------------- hash chain
    def _metadata(self) -> dict:
        meta = {"delta": self.delta, "dataset_size": self.dataset_size,
                "accountant": self.accountant, "run_id": self.run_id}
        if self.shard_sizes is not None:  # absent otherwise: older ledgers' hashes stay valid
            meta["shard_sizes"] = list(self.shard_sizes)
        if self.privacy_unit is not None:  # likewise: example-level ledgers hash as before
            meta["privacy_unit"] = dict(self.privacy_unit)
        if self.noise_mechanism is not None:  # likewise: DP-SGD ledgers hash as before
            meta["noise_mechanism"] = dict(self.noise_mechanism)
        return meta

    def _genesis(self) -> str:
        return hashlib.sha256((_GENESIS + _canonical(self._metadata())).encode()).hexdigest()

    def _entry_hash(self, prev: str, entry: LedgerEntry) -> str:
        payload = _canonical({"entry": entry.record(), "ledger": self._metadata()})
        return hashlib.sha256((prev + payload).encode()).hexdigest()

    def _chain(self) -> list[str]:
        hashes, prev = [], self._genesis()
        for e in self.entries:
            prev = self._entry_hash(prev, e)
            hashes.append(prev)
        return hashes

    @property
    def head(self) -> str:
        """Hash of the last entry (of the metadata alone for an empty ledger)."""
        return self._hashes[-1] if self._hashes else self._genesis()

    def verify(self) -> None:
        """Recompute the hash chain; raise LedgerIntegrityError if entries or metadata were edited
        since they were charged or loaded."""
        if len(self._hashes) != len(self.entries) or self._chain() != self._hashes:
            raise LedgerIntegrityError(
                f"privacy ledger {self.run_id!r} does not match its hash chain: an entry or the "
                "metadata (delta, dataset_size, shard_sizes, accountant, run_id) was edited.")

    # ----------------------------------------------------------------- charging
    def charge(self, sample_rate: float, noise_multiplier: float, sampler: str = "poisson",
               steps: int = 1, bound: Optional[MicroBatchBound] = None) -> None:
        """Record ``steps`` steps of the Poisson-subsampled Gaussian mechanism (q, sigma), with bounded
        micro-batches ``bound`` (None: none).

        Merges into the last entry when (q, sigma, sampler, bound) are identical, else opens a new entry.
        Raises ValueError naming the argument: q not in (0, 1], sigma < 0 or not finite,
        steps < 1, sampler not "poisson"/"shuffle"."""
        _validate(sample_rate, noise_multiplier, sampler, steps)
        q, s, n = float(sample_rate), float(noise_multiplier), int(steps)
        last = self.entries[-1] if self.entries else None
        if last is not None and (last.sample_rate, last.noise_multiplier, last.sampler,
                                 last.micro_batch_bound) == (q, s, sampler, bound):
            last.steps += n
            prev = self._hashes[-2] if len(self._hashes) > 1 else self._genesis()
            self._hashes[-1] = self._entry_hash(prev, last)
        else:
            if blt_of(sampler) is not None and any(e.sampler == sampler for e in self.entries):
                # BLT's ε is that of one Gaussian mechanism over its whole noise stream (accounting/blt.py), at
                # one σ: a second entry of the same stream would be accounted as a separate, weaker release
                raise ValueError(f"noise_mechanism='blt': this step's q={q:g}, σ={s:g} differ from those its noise "
                                 "stream was charged with; BLT is accounted as one Gaussian mechanism at one σ. "
                                 "Keep the run's batch size and noise_multiplier (resume with the same settings).")
            entry = LedgerEntry.of(q, s, n, sampler, bound)
            self.entries.append(entry)
            self._hashes.append(self._entry_hash(self.head, entry))

    @property
    def steps(self) -> int:
        """Total number of charged steps."""
        return sum(e.steps for e in self.entries)

    def epsilon(self, delta: float | None = None, accountant: str | None = None) -> float:
        """Epsilon of all entries at ``delta`` (default: the ledger's) with ``accountant`` (default: the
        ledger's): a valid upper bound on the true epsilon, by
        :func:`~lightning_dpzero.accounting.compute_epsilon` (for "pld" the PLD bound, or the RDP bound
        where that is smaller; :meth:`epsilon_bound` says which). ``math.inf`` if any entry has
        sigma == 0; 0.0 if no steps."""
        return self.epsilon_bound(delta, accountant).epsilon

    def epsilon_bound(self, delta: float | None = None, accountant: str | None = None) -> EpsilonBound:
        """:meth:`epsilon` with what produced it: an :class:`~lightning_dpzero.accounting.EpsilonBound`
        (``.method`` is "pld" or "rdp", with both bounds and the PLD grid)."""
        return epsilon_bound(self.entries, self.delta if delta is None else delta,
                             self.accountant if accountant is None else accountant)

    def same_run(self, other: "PrivacyLedger") -> bool:
        """True if ``other`` belongs to the same run: run_id, delta, dataset_size, accountant equal."""
        return isinstance(other, PrivacyLedger) and self._metadata() == other._metadata()

    def __eq__(self, other) -> bool:
        if not isinstance(other, PrivacyLedger):
            return NotImplemented
        return self.same_run(other) and self.entries == other.entries

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return (f"PrivacyLedger(run_id={self.run_id!r}, delta={self.delta!r}, "
                f"dataset_size={self.dataset_size}, accountant={self.accountant!r}, "
                f"steps={self.steps}, entries={len(self.entries)})")

    # ----------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict:
        """A JSON-able dict: metadata, entries each with its chain hash, and the head hash."""
        self.verify()
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **self._metadata(),
                "versions": dict(self.versions),
                "entries": [{**e.record(), "hash": h} for e, h in zip(self.entries, self._hashes)],
                "head": self.head}

    @classmethod
    def from_dict(cls, d: dict) -> "PrivacyLedger":
        """Rebuild a ledger from :meth:`to_dict` output, verifying the hash chain.

        Raises LedgerIntegrityError if the dict is malformed or any number (steps, q, sigma, delta,
        N, ...) differs from what the hashes recorded."""
        try:
            if d.get("format") != FORMAT or d.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"not a version-{FORMAT_VERSION} {FORMAT} document")
            led = cls(d["delta"], d["dataset_size"], d["accountant"], d["run_id"], d.get("shard_sizes"),
                      d.get("privacy_unit"), d.get("noise_mechanism"))
            led.versions = dict(d.get("versions", {}))
            for item in d["entries"]:
                led.entries.append(LedgerEntry(item["sample_rate"], item["noise_multiplier"],
                                               item["steps"], item["sampler"], item.get("max_micro_batch_size"),
                                               item.get("accumulate_grad_batches"), item.get("rank_sizes")))
                led._hashes.append(str(item["hash"]))
            head = str(d["head"])
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, LedgerIntegrityError):
                raise
            raise LedgerIntegrityError(f"malformed privacy ledger: {exc!r}") from exc
        led.verify()
        if head != led.head:
            raise LedgerIntegrityError("privacy ledger head hash does not match its entries.")
        return led

    def to_json(self) -> str:
        """Pretty JSON of :meth:`to_dict` (floats round-trip exactly)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, s: str) -> "PrivacyLedger":
        """Inverse of :meth:`to_json`; raises LedgerIntegrityError on bad JSON or a broken chain."""
        try:
            d = json.loads(s)
        except json.JSONDecodeError as exc:
            raise LedgerIntegrityError(f"privacy ledger is not valid JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise LedgerIntegrityError("privacy ledger JSON must be an object.")
        return cls.from_dict(d)

    def save(self, path) -> None:
        """Write the JSON atomically: temp file in the same directory, fsync, ``os.replace``, fsync the directory."""
        atomic_write_text(Path(os.fspath(path)).absolute(), self.to_json())

    @classmethod
    def load(cls, path) -> "PrivacyLedger":
        """Read a ledger written by :meth:`save`; raises LedgerIntegrityError if it was edited."""
        with open(os.fspath(path), encoding="utf-8") as f:
            return cls.from_json(f.read())
