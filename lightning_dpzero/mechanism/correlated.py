"""What a run's mechanism holds of its noise: DP-SGD's independent noise, or correlated noise (banded MF,
:mod:`lightning_dpzero.banded_mf`; BLT, :mod:`lightning_dpzero.blt`) with its parts, parameters and state."""

from __future__ import annotations

import secrets
from typing import Any, Callable, Optional

from ..accounting.banded import cyclic_sampler_kind
from ..accounting.blt import BLTParams, blt_for_run, blt_sampler_kind
from ..banded_mf import BandedNoiseSource, banded_coefficients, coefficients_digest
from ..blt import BLTNoiseSource, check_blt_supported
from ..util.options import NoiseMechanism, check_option

__all__ = ["NoiseMechanism", "CorrelatedNoise", "check_same_stream"]


def check_same_stream(ledger, plan) -> None:
    """Refuse resuming a BLT run with another σ or q than its noise stream was charged with (BLT is accounted as
    one Gaussian mechanism over the stream, at one σ: docs/how-to/correlated-noise.md)."""
    kind = getattr(plan, "sampler_kind", None)
    for e in ledger.entries:
        if (e.sampler == kind and str(kind).startswith("cyclic-blt")
                and (e.sample_rate, e.noise_multiplier) != (plan.sample_rate, plan.noise_multiplier)):
            raise ValueError(f"The checkpoint's BLT noise stream was charged at q={e.sample_rate:g}, "
                             f"σ={e.noise_multiplier:g}; this run has q={plan.sample_rate:g}, "
                             f"σ={plan.noise_multiplier:g}. BLT is accounted as one Gaussian mechanism at one σ: "
                             "resume with the run's batch size and noise_multiplier (or its target_epsilon and "
                             "max_steps, which fix the same σ).")



class CorrelatedNoise:
    """The noise mechanism of a run, as :class:`~lightning_dpzero.mechanism.DPMechanism` uses it: DP-SGD's
    independent noise (``"dp-sgd"``, the default: every method is then a no-op), BandMF (``"banded-mf"``) or a
    BLT (``"blt"``, :mod:`lightning_dpzero.blt`).

    For correlated noise it holds what must outlive one noise source: the fixed partition of the training set into
    b parts (its seed, recorded in the ledger and taken from it on resume), a BLT's parameters (optimised for the
    planned steps once, then the ledger's), the noise history or state (from the live source or a checkpoint), and
    the check that each micro-batch was drawn from the part of the step being charged.

    Args:
        noise_mechanism: ``"dp-sgd"``, ``"banded-mf"`` or ``"blt"``.
        bands: b >= 1 for ``"banded-mf"``, b >= 2 cyclic parts for ``"blt"`` (required); None (or 1) for
            ``"dp-sgd"``.
        poisson_sampling, privacy_unit, max_micro_batch_size: the run's settings; BandMF's analysis (cyclic
            Poisson sampling of examples) covers Poisson sampling of examples without a micro-batch bound only.

    Raises:
        ValueError: an unknown mechanism; bands missing, not an integer >= 1, or given for DP-SGD; BandMF (b > 1)
            with fixed-size batches, user-level DP or a micro-batch bound.

    Example:
        >>> CorrelatedNoise("banded-mf", 4).record(partition_seed=7)["bands"]
        4
        >>> CorrelatedNoise("banded-mf", None)
        Traceback (most recent call last):
        ...
        ValueError: noise_mechanism='banded-mf' needs bands=b, the number of bands of C (and of fixed parts the training set is split into): e.g. bands=4; bands=1 is DP-SGD.
    """

    def __init__(self, noise_mechanism: str = "dp-sgd", bands: Optional[int] = None, *, poisson_sampling: bool = True,
                 privacy_unit: str = "example", max_micro_batch_size: Optional[int] = None) -> None:
        self.noise_mechanism = check_option("noise_mechanism", noise_mechanism, NoiseMechanism)
        self.partition_seed: Optional[int] = None
        self.source: Optional[Any] = None     # BandedNoiseSource or BLTNoiseSource
        self.blt_params: Optional[BLTParams] = None
        self._pending: Optional[dict] = None  # a checkpoint's noise state, for the next source
        self._steps: list[int] = []           # the step index of each micro-batch run since the last charge
        if self.noise_mechanism == "dp-sgd":
            if bands not in (None, 1):
                raise ValueError(f"bands={bands!r} is for noise_mechanism='banded-mf' or 'blt'; DP-SGD has no "
                                 "bands. Pass noise_mechanism='banded-mf' too, or drop bands.")
            self.bands = 1
            return
        if bands is None and self.noise_mechanism == "blt":
            raise ValueError("noise_mechanism='blt' needs bands=b, the number of fixed parts the training set is "
                             "split into (an example takes part at most once every b steps): e.g. the steps per "
                             "epoch.")
        if bands is None:
            raise ValueError("noise_mechanism='banded-mf' needs bands=b, the number of bands of C (and of fixed parts "
                             "the training set is split into): e.g. bands=4; bands=1 is DP-SGD.")
        check_blt_supported(bands) if self.noise_mechanism == "blt" else banded_coefficients(bands)
        self.bands = int(bands)
        if self.bands > 1:
            why = ("poisson_sampling=False" if not poisson_sampling else
                   "privacy_unit='user'" if privacy_unit != "example" else
                   "max_micro_batch_size" if max_micro_batch_size is not None else None)
            if why is not None:
                raise ValueError(f"noise_mechanism={self.noise_mechanism!r} with bands={self.bands} does not support "
                                 f"{why}: its "
                                 "privacy analysis covers cyclic Poisson sampling of examples, without a micro-batch "
                                 f"bound. Drop {why}, or use noise_mechanism='dp-sgd'.")

    @property
    def banded(self) -> bool:
        """Whether the noise is correlated (banded MF or BLT)."""
        return self.noise_mechanism != "dp-sgd"

    @property
    def cyclic(self) -> bool:
        """Whether the sampler must be cyclic (b > 1)."""
        return self.banded and self.bands > 1

    def choose_parameters(self, restored: Optional[dict], planned_steps: Optional[int], steps_per_epoch: int,
                          broadcast: Callable[[Any], Any]) -> None:
        """A BLT's θ, ω: the restored ledger's (a resume keeps them), else optimised for the planned steps
        (:func:`~lightning_dpzero.accounting.blt.blt_for_run`), rank 0's result shared, so every rank's ledger is
        the same."""
        if self.noise_mechanism != "blt" or self.blt_params is not None:
            return
        if restored is not None and restored.get("theta") is not None:
            self.blt_params = _blt_of_record(restored)
            return
        found = blt_for_run(planned_steps, steps_per_epoch, self.bands)
        theta, omega = broadcast((list(found.theta), list(found.omega)))
        self.blt_params = BLTParams(tuple(theta), tuple(omega))

    def _fixed_params(self) -> BLTParams:
        if self.blt_params is None:
            raise RuntimeError("noise_mechanism='blt': noise drawn before the plan fixed the BLT's parameters.")
        return self.blt_params

    def sampler_kind(self) -> str:
        """What the ledger charges each step with: ``"cyclic-poisson:<b>"`` or BLT's ``"cyclic-blt:<b>:<θ>;<ω>"``."""
        if self.noise_mechanism == "blt":
            assert self.blt_params is not None, "choose_parameters first"
            return blt_sampler_kind(self.bands, self.blt_params)
        return cyclic_sampler_kind(self.bands)

    def record(self, partition_seed: Optional[int] = None) -> Optional[dict]:
        """What the ledger records (hashed): mechanism, b, the coefficients' digest (and a BLT's θ, ω), the
        partition seed (None for DP-SGD)."""
        if not self.banded:
            return None
        seed = self.partition_seed if partition_seed is None else partition_seed
        blt = self.noise_mechanism == "blt"
        if blt:
            digest = self.blt_params.digest() if self.blt_params is not None else None
        else:
            digest = coefficients_digest(self.bands)
        found = {"mechanism": self.noise_mechanism, "bands": self.bands, "coefficients_digest": digest,
                 "partition_seed": None if seed is None else int(seed)}
        if blt and self.blt_params is not None:
            found.update(theta=list(self.blt_params.theta), omega=list(self.blt_params.omega))
        return found

    def check_restored(self, restored: Optional[dict]) -> None:
        """Refuse a resume whose ledger was written with another mechanism, b or coefficients."""
        mine = self.record(partition_seed=-1)
        theirs = None if restored is None else {**restored, "partition_seed": -1}
        if mine != theirs:
            def text(m):
                if m is None:
                    return "noise_mechanism='dp-sgd'"
                return f"noise_mechanism={m['mechanism']!r}, bands={m['bands']}" + (
                    f", θ={m['theta']}, ω={m['omega']} (a BLT optimised for other planned steps)" if "theta" in m else "")
            raise ValueError(f"The checkpoint's privacy ledger was written with {text(restored)}; this run has "
                             f"{text(mine)}. Changing the noise mechanism or b on resume is not covered by the privacy "
                             "analysis: resume with the checkpoint's settings.")

    def fix_partition(self, restored: Optional[dict], seed: Optional[int], broadcast: Callable[[int], int]) -> None:
        """The partition seed: the restored ledger's (a resume keeps the parts), the run's seed, or OS entropy
        shared by the ranks."""
        if not self.banded or self.partition_seed is not None:
            return
        if restored is not None and restored.get("partition_seed") is not None:
            self.partition_seed = int(restored["partition_seed"])
        else:
            self.partition_seed = int(seed) if seed is not None else int(broadcast(secrets.randbits(62)))

    def sampler_options(self, step_source: Callable[[], int]) -> Optional[dict]:
        """The ``cyclic`` argument of ``private_dataloader`` (None: an ordinary sampler)."""
        if not self.cyclic:
            return None
        return {"bands": self.bands, "partition_seed": self.partition_seed, "step_source": step_source}

    def _new_source(self, base) -> Any:
        if self.noise_mechanism == "blt":  # θ, ω are fixed with the plan, after the optimizer's noise hook
            return BLTNoiseSource(base, self.blt_params if self.blt_params is not None else self._fixed_params)
        return BandedNoiseSource(base, self.bands)

    def wrap(self, base) -> Any:
        """The noise source of a run: ``base`` itself (DP-SGD), or a :class:`BandedNoiseSource` over it that
        continues the checkpoint's noise history (after a load) or the previous source's (a later fit)."""
        if not self.banded:
            return base
        previous, self.source = self.source, self._new_source(base)
        if self._pending is not None:
            self.source.load_state_dict(self._pending)
            self._pending = None
        elif previous is not None:
            self.source.load_state_dict(previous.state_dict())
        return self.source

    def state_dict(self) -> Optional[dict]:
        """This rank's noise state for a checkpoint (None: DP-SGD, or nothing noised yet)."""
        return self.source.state_dict() if self.banded and self.source is not None else None

    def load(self, state: Optional[dict], steps: int, rank: int, restored: Optional[dict] = None,
             sampler: Any = None) -> None:
        """A checkpoint was loaded whose ledger has ``steps`` steps and records ``restored`` (its
        ``noise_mechanism``): its partition is the run's from now on (also for a ``sampler`` built before the load,
        as a Fabric loop builds it), and its noise state ``state`` (this rank's) is the history the next source
        continues. ``ValueError`` if BandMF's state is missing or for another mechanism."""
        if not self.banded:
            return
        if self.noise_mechanism == "blt" and restored is not None and restored.get("theta") is not None:
            # the ledger's θ, ω (a Fabric loop fixed its plan, with θ, ω optimised for its own planned steps,
            # before the load: DPMechanism.resume re-keys that plan)
            self.blt_params = _blt_of_record(restored)
        if restored is not None and restored.get("partition_seed") is not None:
            self.partition_seed = int(restored["partition_seed"])
            if hasattr(sampler, "set_partition"):
                sampler.set_partition(self.partition_seed)
        if state is None:
            if steps == 0 or self.bands == 1:
                self._pending = None
                return
            raise ValueError(f"The checkpoint holds no correlated-noise state for rank {rank}, so the noise cannot "
                             f"continue (a checkpoint written without noise_mechanism={self.noise_mechanism!r}, or by "
                             "another number of processes). Resume from a checkpoint of this run.")
        if self.noise_mechanism == "blt" and self.blt_params is None:
            raise ValueError("The checkpoint's ledger records no BLT parameters: resume from a checkpoint written "
                             "with noise_mechanism='blt'.")
        self._new_source(_NoBase()).load_state_dict(state)  # refuses another mechanism or coefficients now
        self._pending = state

    def note_micro_batch(self, sampler: Any) -> None:
        """A micro-batch is about to run: the step index the cyclic ``sampler`` drew it for."""
        if self.cyclic and sampler is not None and hasattr(sampler, "pop_step"):
            found = sampler.pop_step()
            if found is not None:
                self._steps.append(found)

    def check_step(self, step: int) -> None:
        """Before step ``step`` (0-based) is charged and applied: every micro-batch of it came from part
        ``step mod b``. ``RuntimeError`` otherwise (a batch drawn for another step: the separation of an example's
        participations, on which the noise's sensitivity rests, would not hold)."""
        drawn, self._steps = self._steps, []
        wrong = sorted({t for t in drawn if t % self.bands != step % self.bands})
        if wrong:
            raise RuntimeError(f"noise_mechanism={self.noise_mechanism!r}: optimizer step {step} ran micro-batches drawn for "
                               f"step(s) {wrong} (part {wrong[0] % self.bands} instead of {step % self.bands}), so an "
                               "example could take part twice within b steps. Train on the loader the strategy "
                               "builds, without skipping or reordering its batches.")

    def check_precision(self, fp16: bool) -> None:
        """Refuse DeepSpeed's fp16 (a skipped overflow step would leave the noise history behind the parts)."""
        if self.cyclic and fp16:
            raise ValueError(f"noise_mechanism={self.noise_mechanism!r} does not support DeepSpeed's fp16 with dynamic loss "
                             "scaling: an overflow skips an update that the parts' schedule counts. Use "
                             "precision='bf16-mixed' or 32, or noise_mechanism='dp-sgd'.")


def _blt_of_record(record: dict) -> BLTParams:
    """A BLT's θ, ω from the ledger's ``noise_mechanism`` record."""
    return BLTParams(tuple(record["theta"]), tuple(record["omega"]))


class _NoBase:
    secure_mode, replicated, rank = False, True, 0
