"""Gaussian noise on the optimizer's own partition (docs/design.md, *Where each piece runs*: step; I3).

DeepSpeed hands the *base* optimizer this rank's fp32 partition of the reduced gradient. A step pre-hook
on that optimizer turns it into the released DP gradient, in place::

    p.grad ← ( p.grad · W  +  σ · C_tot · z ) / B_exp ,    z ~ N(0, I)

where ``p.grad · W`` undoes DeepSpeed's average over the W data-parallel ranks (what arrives is the
rank-mean of the per-rank sums of clipped gradients). Each coordinate is noised exactly once per step:

* ZeRO stages 1–3: every rank owns a disjoint partition and draws from its own stream;
* stage 0: every rank holds the full gradient, so all ranks draw the *same* noise from a shared stream
  (secure mode: rank 0 draws from OS entropy and broadcasts).
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist


def secure_normal(shape, dtype=torch.float32, device=None) -> torch.Tensor:
    """Standard normal draws from the OS CSPRNG (``os.urandom``) by the Box–Muller transform, in float64.

    No seed exists, so no checkpoint or log can reproduce the noise.
    """
    n = int(np.prod(shape)) if len(shape) else 1
    m = (n + 1) // 2
    raw = np.frombuffer(os.urandom(16 * m), dtype=np.uint64).reshape(2, m)
    u1 = ((raw[0] >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]
    u2 = (raw[1] >> np.uint64(11)).astype(np.float64) * 2.0**-53
    r = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([r * np.cos(2 * math.pi * u2), r * np.sin(2 * math.pi * u2)])[:n]
    return torch.from_numpy(z).reshape(shape).to(device=device, dtype=dtype)


class NoiseSource:
    """Where the noise comes from.

    Args:
        seed: base seed of the PRNG stream (ignored in secure mode). Partitioned ranks use ``seed + rank``
            so their streams differ; replicated ranks all use ``seed``.
        secure_mode: draw from the OS CSPRNG instead of a seeded PRNG.
        replicated: every rank holds the full gradient (ZeRO stage 0).
        rank: this process's data-parallel rank.

    Example:
        >>> import torch
        >>> a = NoiseSource(seed=7, secure_mode=False, replicated=False, rank=0).normal((3,), "cpu")
        >>> b = NoiseSource(seed=7, secure_mode=False, replicated=False, rank=1).normal((3,), "cpu")
        >>> c = NoiseSource(seed=7, secure_mode=False, replicated=True, rank=1).normal((3,), "cpu")
        >>> torch.equal(a, b), torch.equal(a, c)  # partitions: a stream per rank; stage 0: one shared stream
        (False, True)
    """

    def __init__(self, seed: int, secure_mode: bool, replicated: bool, rank: int):
        self.secure_mode, self.replicated, self.rank = secure_mode, replicated, rank
        self._seed = int(seed) + (0 if replicated else int(rank))
        self._gens: dict[str, torch.Generator] = {}

    def _generator(self, device) -> torch.Generator:
        # One stream per device type, drawn where the gradient lives (no host-to-GPU copy of the noise).
        key = torch.device(device).type
        if key not in self._gens:
            self._gens[key] = torch.Generator(device=device).manual_seed(self._seed)
        return self._gens[key]

    def normal(self, shape, device) -> torch.Tensor:
        if not self.secure_mode:
            return torch.randn(shape, generator=self._generator(device), dtype=torch.float32, device=device)
        if not self.replicated or not (dist.is_available() and dist.is_initialized()):
            return secure_normal(shape, device=device)
        z = secure_normal(shape, device=device) if self.rank == 0 else torch.empty(shape, device=device)
        dist.broadcast(z, src=0)
        return z


def make_noise_pre_hook(get_scales: Callable[[], tuple[float, float]], source: NoiseSource,
                        on_applied: Callable[[], None],
                        check: Optional[Callable[[torch.optim.Optimizer], None]] = None):
    """A ``torch.optim.Optimizer.register_step_pre_hook`` hook adding the DP noise in place.

    ``get_scales()`` returns ``(grad_mult, noise_std)``: each gradient coordinate ``x`` becomes
    ``x · grad_mult + noise_std · z`` (fp32). A parameter with no gradient is noised from zero: every
    trainable coordinate is released with noise, even one that received no gradient this step. ``check(optimizer)``
    runs first and may raise to refuse the update before any gradient or parameter is changed.
    """

    def hook(optimizer, args, kwargs):
        if check is not None:
            check(optimizer)
        grad_mult, std = get_scales()
        if std > 0 and hasattr(source, "begin_step"):  # correlated noise (banded_mf.BandedNoiseSource): one step
            source.begin_step()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.mul_(grad_mult)
                if std > 0:
                    p.grad.add_(source.normal(p.grad.shape, p.grad.device).to(p.grad.dtype), alpha=std)
        on_applied()
        return None

    return hook


EXPLICIT_SEED_WARNING = (
    "An explicit seed reproduces the noise and the Poisson batches: two runs with the same seed draw the same "
    "noise, so two models trained with one seed on neighbouring datasets reveal their difference, noise-free. "
    "Use a seed for tests and debugging only; production runs should use secure_mode=True (or no seed).")


def warn_explicit_seed() -> None:
    """Warn, on rank 0, that an explicit seed reproduces the noise (each fit that has one)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(EXPLICIT_SEED_WARNING)


def derive_stream_seed(seed: int, run_id: str, steps: int, head: str, fit: int = 0) -> int:
    """A 62-bit seed for the streams of a fit that continues a ledger at (run id, steps, head hash) from the run's
    ``seed``: deterministic (every rank, every process continuing from that position, gets it) and distinct per
    position and per ``fit`` (the number of earlier fits of the same process), so no two fits of one lineage replay
    each other's noise or batches, and neither do two fits of one process that start from the same position.

    Example:
        >>> a, b = derive_stream_seed(5, "run", 3, "ab"), derive_stream_seed(5, "run", 6, "cd")
        >>> a == derive_stream_seed(5, "run", 3, "ab"), a != b, a != derive_stream_seed(5, "run", 3, "ab", fit=1)
        (True, True, True)
    """
    extra = f":{fit}" if fit else ""  # (a process's first fit: the seed as before, so resumes reproduce)
    digest = hashlib.sha256(f"{seed}:{run_id}:{steps}:{head}{extra}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


class StreamSeeds:
    """The seed of each fit's noise and sampling streams (docs/reliability.md, *Rollbacks*).

    The streams are renewed (:meth:`renew`) when a fit starts and when a checkpoint is loaded. Without an explicit
    seed each renewal draws a fresh 62-bit seed from OS entropy (the same on every rank): two fits from one
    checkpoint, or the steps after a rollback to an earlier checkpoint, never share noise, and no seed is stored
    anywhere. With an explicit ``seed`` the streams are reproducible: a process's first fit uses the seed (a fresh
    ledger) or :func:`derive_stream_seed` of it and the ledger's position; every later renewal of the same process
    also mixes in its number, so a rollback inside one process never repeats noise. Two *processes* resumed from
    one checkpoint with the same explicit seed do draw the same noise: that is what the seed reproduces
    (:data:`EXPLICIT_SEED_WARNING`).

    Example:
        >>> seeds = StreamSeeds(None)
        >>> seeds.renew(lambda s: s); first = seeds.for_position(None)
        >>> seeds.renew(lambda s: s); first != seeds.for_position(None)  # fresh OS entropy at every renewal
        True
        >>> seeds = StreamSeeds(7)
        >>> seeds.renew(lambda s: s); seeds.for_position(None)
        7
    """

    def __init__(self, seed: Optional[int]):
        self.given = seed    #: the user's seed (None: none)
        self.base = seed     #: the current streams' seed (drawn at :meth:`renew` without a given one)
        self.renewals = 0    #: fits started and checkpoints loaded by this process

    def renew(self, broadcast: Callable[[int], int]) -> None:
        """A fit starts or a checkpoint was loaded; ``broadcast`` hands rank 0's value to every rank (the drawn
        seed must agree)."""
        self.renewals += 1
        if self.given is None:
            self.base = int(broadcast(secrets.randbits(62)))

    def for_position(self, ledger) -> Optional[int]:
        """The streams' seed of a fit that continues ``ledger`` (None or empty: a new ledger)."""
        if self.base is None or self.given is None:
            return self.base
        fit = max(self.renewals - 1, 0)
        if (ledger is None or ledger.steps == 0) and fit == 0:
            return self.base
        steps, run_id, head = (0, "", "") if ledger is None else (ledger.steps, ledger.run_id, ledger.head)
        return derive_stream_seed(self.base, run_id, steps, head, fit)
