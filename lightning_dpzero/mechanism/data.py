"""The private loader, the plan and the ledger it opens: the part of :class:`~lightning_dpzero.mechanism.DPMechanism`
that knows the training data (its Poisson, user-level or cyclic sampler) and fixes what every step is charged."""

from __future__ import annotations

import dataclasses
import secrets
from typing import Optional

import torch
from torch.utils.data import DataLoader

from ..accounting import PrivacyLedger
from ..accounting.plan import PrivacyPlan
from ..banded_mf import check_banded_supported
from .correlated import check_same_stream
from ..sampling.shards import describe_training_data, private_training_loader
from ..sampling.users import unit_text, user_level_loader


class PlanAndData:
    """:class:`~lightning_dpzero.mechanism.DPMechanism`'s data and plan (a mixin of it: its state is the
    mechanism's)."""

    def private_loader(self, dataloader: DataLoader, accumulate_grad_batches: int, pre_sharded: bool = False
                       ) -> DataLoader:
        """The training loader over the same dataset with the distributed Poisson (or shuffled) sampler at
        ``q = B·W·K/N`` (:func:`lightning_dpzero.sampling.shards.private_training_loader`, which lists what it raises)."""
        options = dict(pre_sharded=pre_sharded, poisson=self.poisson_sampling, seed=self.seed,
                       secure_mode=self.secure_mode, max_micro_batch_size=self.max_micro_batch_size)
        self._loader_sampler = None
        if self.correlated.cyclic:  # BandMF: the parts are fixed once per run (resumes keep the ledger's)
            restored = None if self._restored is None else self._restored.noise_mechanism
            self.correlated.fix_partition(restored, self._seeds.given, self.collectives.broadcast)
            loader = private_training_loader(dataloader, self.collectives, accumulate_grad_batches, **options,
                                             cyclic=self.correlated.sampler_options(self._charged_steps))
            self._loader_sampler = loader.batch_sampler
            return loader
        if self.privacy_unit == "user":  # Poisson sampling over users (sampling/users.py)
            data = describe_training_data(dataloader, self.collectives.world_size, pre_sharded)
            loader = user_level_loader(dataloader, self.collectives, accumulate_grad_batches, **options,
                                       max_examples_per_user=self.max_examples_per_user, batch_sizes=data.batch_sizes)
            self._user_sampler = loader.batch_sampler
            return loader
        return private_training_loader(dataloader, self.collectives, accumulate_grad_batches, **options)

    def fix_plan(self, loader: DataLoader, *, accumulate_grad_batches: int, micro_batches_per_epoch: int,
                 max_steps: Optional[int], max_epochs: Optional[int]) -> PrivacyPlan:
        """Fix the plan for the loader from :meth:`private_loader` (σ calibrated if asked) and open the ledger.
        A plan fixed again (a reloaded loader) keeps the σ of the first."""
        steps_per_epoch = max(micro_batches_per_epoch // accumulate_grad_batches, 1)
        if self.correlated.cyclic:  # the ledger's sampler: BandMF's, or a BLT's with its θ, ω (fixed once)
            restored = None if self._restored is None else self._restored.noise_mechanism
            planned = max_steps if max_steps is not None and max_steps > 0 else (
                max_epochs * steps_per_epoch if max_epochs is not None and max_epochs > 0 else None)
            self.correlated.choose_parameters(restored, planned, steps_per_epoch, self.collectives.broadcast)
            loader.batch_sampler.sampler_kind = self.correlated.sampler_kind()
        plan = PrivacyPlan.for_sampler(
            loader.batch_sampler, self.accounting, noise_multiplier=self.noise_multiplier,
            max_micro_batch_size=self.max_micro_batch_size, accumulate_grad_batches=accumulate_grad_batches,
            micro_batches_per_epoch=micro_batches_per_epoch, max_steps=max_steps, max_epochs=max_epochs)
        if self.correlated.banded:
            check_banded_supported(self.bands, steps_per_epoch, self.poisson_sampling, self.noise_mechanism)
            plan = dataclasses.replace(plan, noise_mechanism=self.correlated.record())
        self.use_plan(plan)
        return plan

    def use_plan(self, plan: PrivacyPlan) -> None:
        """Charge every step with ``plan`` and open the ledger: the restored one, after checking it is for the
        same N and δ, else (once) a new one with a run id shared by the ranks."""
        self.plan = plan
        restored = self._restored
        if restored is not None:
            if restored.privacy_unit != plan.privacy_unit:
                raise ValueError(
                    f"The checkpoint's privacy ledger is for privacy unit {unit_text(restored.privacy_unit)}; this "
                    f"run's is {unit_text(plan.privacy_unit)}. Resume with the strategy's privacy_unit and "
                    "max_examples_per_user as the run was started with (its ε is in those units).")
            self.correlated.check_restored(restored.noise_mechanism)
            check_same_stream(restored, plan)
            if restored.dataset_size != plan.dataset_size or restored.delta != plan.delta:
                raise ValueError(
                    f"The checkpoint's privacy ledger is for N={restored.dataset_size}, δ={restored.delta}; this "
                    f"run has N={plan.dataset_size}, δ={plan.delta}. Resume with the same data and delta.")
            self.ledger = restored
        elif self.ledger is None:
            # one run id on every rank, so every rank's copy of the ledger is the same document
            run_id = self.collectives.broadcast(secrets.token_hex(16))
            self.ledger = PrivacyLedger(delta=plan.delta, dataset_size=plan.dataset_size,
                                        accountant=plan.accountant, run_id=run_id, shard_sizes=plan.shard_sizes,
                                        privacy_unit=plan.privacy_unit, noise_mechanism=plan.noise_mechanism)

    def units_of(self, batch_size: Optional[int]) -> Optional[torch.Tensor]:
        """With ``privacy_unit="user"``: the user of each row of the micro-batch about to run (its sampler's, in the
        order drawn), ``(B,)`` for ``PerSampleEngine.start_micro_batch(units=...)``; ``None`` otherwise or for an
        empty one.

        Raises:
            RuntimeError: the micro-batch is not the size the sampler drew (a batch it did not draw)."""
        self.correlated.note_micro_batch(self._loader_sampler)  # BandMF: the step its part was drawn for
        if self._user_sampler is None:
            return None
        units = self._user_sampler.pop_units()
        if batch_size is not None and len(units) != batch_size:
            raise RuntimeError(f"privacy_unit='user': the micro-batch has {batch_size} rows but the user-level "
                               f"sampler drew {len(units)} for it, so its rows' users are unknown. Train on the "
                               "loader the strategy builds, and keep each batch's rows (no filtering in collate).")
        return torch.from_numpy(units) if len(units) else None

    def _charged_steps(self) -> int:
        return self.ledger.steps if self.ledger is not None else 0
