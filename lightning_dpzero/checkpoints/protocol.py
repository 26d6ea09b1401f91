"""The save and load protocol of a DP checkpoint, for any strategy that writes DeepSpeed checkpoints.

:class:`CheckpointProtocol` holds the order of a save (the commit marker last) and the checks of a load (the
marker and the files before anything is unpickled; the ledgers against each other, the marker and the weights'
step count after), as docs/design.md, *Checkpoints*, and docs/reliability.md describe them. It talks to the
other ranks through :class:`~lightning_dpzero.util.collectives.Collectives` (any Lightning strategy) and leaves the
writing and reading of the shards to the caller's DeepSpeed functions.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ..util.atomic import atomic_write_text, fsync_dir
from ..util.collectives import Collectives, gather_dicts, gather_lists
from ..accounting import PrivacyLedger
from .commit import (CheckpointIntegrityError, check_commit_matches, checkpoint_files, file_digest, file_problems,
                     raise_file_problems, write_commit)
from .format import (COMMIT_FILE, COMMIT_FORMAT, COMMIT_FORMAT_VERSION, INCOMPLETE_FILE, LEDGER_FILE, LEDGER_KEY,
                     NOISE_STATE_FILE)
from .safe_load import raise_escaping_paths
from .verify import check_ledgers, check_steps_cover, check_world_size, raise_unsafe, require_commit, scan_problems


class CheckpointProtocol:
    """Writes a DeepSpeed checkpoint so that a half-written one is refused, and verifies one before loading it.

    Args:
        collectives: the ranks of the run (a Lightning strategy); every method is called on every rank.

    Example:
        >>> import pathlib, tempfile
        >>> from lightning_dpzero import PrivacyLedger
        >>> from lightning_dpzero.util.collectives import SingleProcess
        >>> ledger = PrivacyLedger(delta=1e-5, dataset_size=100)
        >>> ledger.charge(sample_rate=0.1, noise_multiplier=1.0)
        >>> tmp = tempfile.TemporaryDirectory()
        >>> directory = pathlib.Path(tmp.name) / "step=1.ckpt"
        >>> def write_shards(checkpoint, path):  # the strategy passes DeepSpeed's save_checkpoint
        ...     (pathlib.Path(path) / "latest").write_text("checkpoint")
        >>> protocol = CheckpointProtocol(SingleProcess())
        >>> protocol.save({"global_step": 1}, directory, ledger, write_shards, zero_stage=2)
        >>> sorted(p.name for p in directory.iterdir())
        ['latest', 'privacy_commit.json', 'privacy_ledger.json']
        >>> protocol.verify(directory, required=True, trust_pickles=False)["ledger_steps"]
        1
        >>> tmp.cleanup()
    """

    def __init__(self, collectives: Collectives) -> None:
        self.dist = collectives

    def save(self, checkpoint: dict, filepath, ledger: Optional[PrivacyLedger],
             write_shards: Callable[[dict, Any], None], zero_stage: int, noise_state: Optional[dict] = None) -> None:
        """DeepSpeed's checkpoint, the ledger twice, then the commit marker, in this order on disk:

        1. rank 0 marks the directory incomplete and removes any old ``privacy_commit.json`` (so an old marker can
           never vouch for shards overwritten in place), barrier;
        2. every rank writes its ZeRO shards with ``write_shards(checkpoint, filepath)`` (the ledger rides in the
           client state, key ``privacy_ledger``), and its ``noise_state`` (correlated noise: the history of its
           partition; any rank's may be None), ``privacy_noise_rank<r>.pt``;
        3. rank 0 writes ``privacy_ledger.json`` atomically, barrier;
        4. the ranks hash every file of the directory (split between them), rank 0 writes ``privacy_commit.json``
           atomically (ledger run id, head hash and steps, ``global_step``, sizes and SHA-256 of the files) and
           removes the incomplete mark, barrier.

        A process killed anywhere before 4 leaves a directory without a valid marker, which :meth:`verify`
        refuses.
        """
        dist = self.dist
        filepath = dist.broadcast(filepath)
        directory = Path(filepath)
        if dist.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write_text(directory / INCOMPLETE_FILE, "checkpoint being written; not usable\n")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / COMMIT_FILE)
            fsync_dir(directory)
        dist.barrier("dp_checkpoint_begin")
        if ledger is not None:
            checkpoint[LEDGER_KEY] = ledger.to_dict()
        write_shards(checkpoint, filepath)
        if noise_state is not None:
            import torch

            torch.save(noise_state, directory / NOISE_STATE_FILE.format(rank=dist.global_rank))
        if ledger is not None and dist.is_global_zero:
            ledger.save(directory / LEDGER_FILE)
        dist.barrier("dp_ledger_saved")
        files = self._hash_files(directory)
        if dist.is_global_zero:
            commit = {
                "format": COMMIT_FORMAT, "format_version": COMMIT_FORMAT_VERSION,
                "global_step": int(checkpoint.get("global_step", -1)),
                "run_id": ledger.run_id if ledger is not None else None,
                "ledger_head": ledger.head if ledger is not None else None,
                "ledger_steps": ledger.steps if ledger is not None else None,
                "world_size": dist.world_size, "zero_stage": zero_stage,
                "created_unix": time.time(), "files": files,
            }
            write_commit(directory, commit)
        dist.barrier("dp_checkpoint_committed")

    def _share(self, names: list[str]) -> list[str]:
        """This rank's share of a list every rank holds alike."""
        return names[self.dist.global_rank::self.dist.world_size]

    def _hash_files(self, directory: Path) -> dict[str, dict[str, Any]]:
        """``{relative path: {"size", "sha256"}}`` of every file under ``directory`` (all ranks hash a share)."""
        dist = self.dist
        names = dist.broadcast(checkpoint_files(directory) if dist.is_global_zero else None)
        mine = {n: file_digest(directory / n) for n in self._share(names)}
        return gather_dicts(mine, dist.world_size)

    def invalidate(self, filepath) -> None:
        """Before a checkpoint is deleted: remove its marker first, so a deletion killed half-way leaves a
        directory that :meth:`verify` refuses."""
        if self.dist.is_global_zero and Path(filepath).is_dir():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(Path(filepath) / COMMIT_FILE)

    def verify(self, checkpoint_path, required: bool, trust_pickles: bool, zero_stage: Optional[int] = None
               ) -> Optional[dict]:
        """Before DeepSpeed unpickles anything, the checks of :mod:`~lightning_dpzero.checkpoints.verify`: the
        commit marker (``required``, i.e. when fitting; otherwise a directory without marker loads with a warning
        unless it was left half-written), every file against its size and SHA-256 (the ranks share the hashing),
        every ``.pt`` file with ``torch.load(weights_only=True)`` (unless ``trust_pickles``), and, when fitting, the
        ledgers against each other, the marker and the weights' step counts, and the number of processes the
        shards were written for (``zero_stage``: this run's). Every rank reaches the same verdict. Returns the
        marker (None for a path that is not a directory, or has none).

        Raises:
            UnsafeCheckpointError: a link in the directory, or a ``latest`` tag naming a folder outside it (first);
                a file holds objects that unpickling could execute.
            IncompleteCheckpointError: no marker (the save was interrupted, or the marker was removed).
            CheckpointIntegrityError: the files, the ledgers, the marker or the step counts disagree.
            UnsafeCheckpointError: a file holds objects that unpickling could execute.
            ValueError: ZeRO shards written by another number of processes, which DeepSpeed cannot load.
        """
        path = Path(checkpoint_path)
        if not path.is_dir():
            return None
        self._agreed(lambda: raise_escaping_paths(path))  # every file DeepSpeed opens is one the checks below see
        commit = self._agreed(lambda: require_commit(path, required, trust_pickles))
        if commit is None:
            if not required:
                rank_zero_warn(f"{path} has no {COMMIT_FILE} (not written by DPDeepSpeedStrategy); loading "
                               "it unverified.")
            return None  # when fitting: not written by this strategy; the ledger check names the problem
        problems = file_problems(path, commit, self._share(sorted(commit["files"])),
                                 check_unlisted=self.dist.is_global_zero)
        raise_file_problems(path, gather_lists(problems, self.dist.world_size))
        if not trust_pickles:
            self._scan_pickles(path)
        if required:
            self._agreed(lambda: check_ledgers(path, commit, trust_pickles))
            check_world_size(path, commit, self.dist.world_size, zero_stage)
        return commit

    def _agreed(self, check: Callable[[], Any]) -> Any:
        """``check()`` on rank 0; its result, or the error it raised, on every rank (a refusal on one rank only
        would leave the others waiting in DeepSpeed's collectives)."""
        outcome = None
        if self.dist.is_global_zero:
            try:
                outcome = (True, check())
            except (ValueError, OSError) as exc:  # the checkpoint errors are ValueErrors
                outcome = (False, exc)
        ok, value = self.dist.broadcast(outcome) if self.dist.world_size > 1 else outcome
        if not ok:
            raise value
        return value

    def _scan_pickles(self, directory: Path) -> None:
        """``torch.load(weights_only=True)`` every ``.pt`` file before DeepSpeed unpickles it fully."""
        dist = self.dist
        names = dist.broadcast(sorted(n for n in checkpoint_files(directory) if n.endswith(".pt"))
                               if dist.is_global_zero else None)
        raise_unsafe(directory, gather_lists(scan_problems(directory, self._share(names)), dist.world_size))

    def noise_state(self, checkpoint_path) -> Optional[dict]:
        """This rank's noise state in a verified checkpoint (``torch.load(weights_only=True)``), None if it has
        none."""
        path = Path(checkpoint_path) / NOISE_STATE_FILE.format(rank=self.dist.global_rank)
        if not path.is_file():
            return None
        import torch

        return torch.load(path, map_location="cpu", weights_only=True)

    @staticmethod
    def loaded_ledger(checkpoint_path, checkpoint: dict, commit: Optional[dict]) -> PrivacyLedger:
        """After DeepSpeed loaded ``checkpoint`` for fitting: the ledger it continues. The ledger in the client
        state, ``privacy_ledger.json`` and the marker must all be the same ledger, and cover at least the
        checkpoint's ``global_step``.

        Raises:
            CheckpointIntegrityError: the ledgers or the marker disagree, or the ledger charges too few steps.
            ValueError: no ledger at all.
        """
        path = Path(checkpoint_path)
        on_disk = path / LEDGER_FILE
        from_state = checkpoint.get(LEDGER_KEY)
        if from_state is None and not on_disk.exists():
            raise ValueError(f"The checkpoint {checkpoint_path} holds no privacy ledger, so the privacy already "
                             "spent is unknown. Resume only from checkpoints written by DPDeepSpeedStrategy, or "
                             "load the weights into a fresh run (new ledger) without ckpt_path.")
        ledger = PrivacyLedger.from_dict(from_state) if from_state is not None else None
        if on_disk.exists():
            disk = PrivacyLedger.load(on_disk)
            if ledger is not None and disk != ledger:
                raise CheckpointIntegrityError(
                    f"{on_disk} and the ledger inside the checkpoint disagree; the checkpoint may have been edited "
                    "or mixed with another run. Refusing to resume.")
            ledger = disk
        global_step = int(checkpoint.get("global_step", 0))
        if commit is not None:
            check_commit_matches(path, commit, ledger, global_step)
        check_steps_cover(checkpoint_path, ledger, global_step)
        return ledger
