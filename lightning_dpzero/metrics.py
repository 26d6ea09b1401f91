"""DP training statistics as torchmetrics, and logging of the DP settings and the ledger to any logger.

* :class:`ClipFraction` and :class:`MeanGradNorm`: the share of examples whose gradient norm exceeded C,
  and the mean per-example gradient norm, over all the examples of an optimizer step. Their states are
  sums (``dist_reduce_fx="sum"``), so updating once per micro-batch on every rank and calling
  :meth:`~torchmetrics.Metric.compute` once per step gives the value over the whole logical batch: every
  accumulation micro-batch on every rank, each example weighted once (not a mean of per-rank means).
* :func:`dp_hyperparameters`: the run's DP settings (σ, q, C, δ, target ε, N, planned steps, clipping,
  sampler, accountant, ZeRO stage, ...) as a dict, for ``logger.log_hyperparams``.
* :class:`PrivacyRunLogger`: a callback that records those settings in every logger's hyperparameters
  (the W&B run's config) when training starts, and at the end of fit attaches the privacy ledger:
  to a W&B run as an artifact of type ``"privacy-ledger"`` holding ``privacy_ledger.json``, and for
  loggers with a ``log_dir`` (CSV, TensorBoard) as ``privacy_ledger.json`` in that directory.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torchmetrics import Metric
from typing_extensions import override

from .checkpoints.format import LEDGER_FILE
from .mechanism import DPMechanism
from .wandb_offline import LEDGER_ARTIFACT_TYPE

Number = Union[int, float, torch.Tensor]



def _scalar(value: Number, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.numel() != 1:
        raise ValueError(f"expected a single number, got a tensor of shape {tuple(t.shape)}")
    return t.reshape(())


def _norms(value: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() != 1:
        raise ValueError(f"per-example norms must be a 1-D tensor (one norm per example), got shape {tuple(t.shape)}; "
                         "to add counts instead, pass `examples=` as well.")
    return t.detach()


class ClipFraction(Metric):
    """Fraction of examples whose per-example gradient norm exceeded the clipping bound C.

    Two ways to update (any number of times: per micro-batch, per rank):

    * ``update(norms)``: a 1-D tensor of per-example gradient norms; counts those ``> max_grad_norm``.
    * ``update(clipped, examples=n)``: counts already made, e.g. ``PerSampleEngine.stats["clipped"]`` and
      ``stats["examples"]``.

    ``compute()`` returns ``Σ clipped / Σ examples`` over everything since the last ``reset()``, summed
    over all processes of the default group when ``torch.distributed`` is initialised (every rank must
    call it: it is a collective). With no example at all (an empty Poisson step everywhere) it is NaN.

    Args:
        max_grad_norm: C; needed only for ``update(norms)``. ``inf``: nothing counts as clipped.

    Example:
        >>> import torch
        >>> metric = ClipFraction(max_grad_norm=1.0)
        >>> metric.update(torch.tensor([0.5, 2.0, 3.0]))  # micro-batch 1: 2 of 3 examples clipped
        >>> metric.update(0, examples=7)                   # micro-batch 2, as counts: none of 7
        >>> metric.compute()
        tensor(0.2000)
    """

    full_state_update = False
    higher_is_better = None
    is_differentiable = False

    def __init__(self, max_grad_norm: Optional[float] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        self.add_state("clipped", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("examples", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, value: Number, examples: Optional[Number] = None) -> None:
        if examples is None:
            if self.max_grad_norm is None:
                raise ValueError("ClipFraction.update(norms) needs ClipFraction(max_grad_norm=C); or pass counts: "
                                 "update(clipped, examples=n).")
            norms = _norms(value)
            clipped = (norms > self.max_grad_norm).sum() if not math.isinf(self.max_grad_norm) else 0
            n = norms.numel()
        else:
            clipped, n = value, examples
        clipped = _scalar(clipped, torch.long, self.clipped.device)
        n = _scalar(n, torch.long, self.examples.device)
        if not 0 <= int(clipped) <= int(n):
            raise ValueError(f"clipped={int(clipped)} must be between 0 and examples={int(n)}")
        self.clipped += clipped
        self.examples += n

    def compute(self) -> torch.Tensor:
        if int(self.examples) == 0:
            return torch.tensor(float("nan"))
        return self.clipped.double().div(self.examples.double()).float()


class MeanGradNorm(Metric):
    """Mean per-example gradient norm (before clipping), over all examples, micro-batches and ranks.

    * ``update(norms)``: a 1-D tensor of per-example norms.
    * ``update(norm_sum, examples=n)``: a sum of n norms already made, e.g. ``PerSampleEngine.stats["norm_sum"]``
      and ``stats["examples"]``.

    ``compute()`` returns ``Σ norms / Σ examples`` (float64 sums; a collective under ``torch.distributed``);
    NaN when there was no example.

    Example:
        >>> import torch
        >>> metric = MeanGradNorm()
        >>> metric.update(torch.tensor([1.0, 3.0]))
        >>> metric.update(12.0, examples=4)  # a sum of 4 norms, e.g. from the engine's statistics
        >>> metric.compute()
        tensor(2.6667)
    """

    full_state_update = False
    higher_is_better = None
    is_differentiable = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("norm_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("examples", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, value: Number, examples: Optional[Number] = None) -> None:
        if examples is None:
            norms = _norms(value)
            total, n = norms.double().sum(), norms.numel()
        else:
            total, n = value, examples
        total = _scalar(total, torch.float64, self.norm_sum.device)
        n = _scalar(n, torch.long, self.examples.device)
        if int(n) < 0 or not bool(torch.isfinite(total)) or float(total) < 0:
            raise ValueError(f"norm_sum={float(total)!r} must be finite and >= 0, examples={int(n)} >= 0")
        self.norm_sum += total
        self.examples += n

    def compute(self) -> torch.Tensor:
        if int(self.examples) == 0:
            return torch.tensor(float("nan"))
        return (self.norm_sum / self.examples.double()).float()


# ---------------------------------------------------------------------------------------------- settings
def _mechanism(strategy, who: str) -> DPMechanism:
    mechanism = getattr(strategy, "mechanism", None)
    if not isinstance(mechanism, DPMechanism):
        raise TypeError(f"{who} needs a DP strategy (a DPDeepSpeedStrategy), got {type(strategy).__name__}")
    return mechanism


def dp_hyperparameters(trainer) -> dict[str, Any]:
    """The DP settings of ``trainer``'s run (its strategy must be a :class:`DPDeepSpeedStrategy`).

    Call it once the privacy plan is fixed (from ``on_train_start`` on); before that σ, q and N are None, and
    δ, the target ε and the accountant are those the accountant callback handed over at setup.
    Values are plain Python numbers and strings, so any logger can store them.
    """
    strategy = trainer.strategy
    mechanism = _mechanism(strategy, "dp_hyperparameters")
    plan, accounting, ledger = mechanism.plan, mechanism.accounting, mechanism.ledger
    out: dict[str, Any] = {
        "noise_multiplier": mechanism.noise_multiplier,
        "sample_rate": plan.sample_rate if plan else None,
        "expected_batch_size": plan.expected_batch_size if plan else None,
        "dataset_size": plan.dataset_size if plan else None,
        "planned_steps": plan.planned_steps if plan else None,
        "delta": plan.delta if plan else accounting.delta,
        "target_epsilon": plan.target_epsilon if plan else accounting.target_epsilon,
        "accountant": plan.accountant if plan else accounting.accountant,
        "sampler": plan.sampler_kind if plan else ("poisson" if mechanism.poisson_sampling else "shuffle"),
        "max_grad_norm": mechanism.max_grad_norm,
        "clipping": strategy.clipping,
        "clipping_fn": strategy.clipping_fn,
        "secure_mode": mechanism.secure_mode,
        "zero_stage": strategy.zero_stage,
        "world_size": trainer.world_size,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "ledger_run_id": ledger.run_id if ledger is not None else None,
    }
    if strategy.clipping == "automatic" or strategy.clipping_fn == "automatic":
        out["gamma"] = strategy.gamma
    if strategy.clipping != "layer-wise":
        out["clipping_mode"] = strategy.clipping_mode
    if strategy.clipping == "group-wise":
        out["clipping_groups"] = str(strategy.clipping_groups)
        out["group_max_grad_norms"] = strategy.group_max_grad_norms
    return out


def _is_wandb_logger(logger) -> bool:
    try:
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:  # pragma: no cover
        return False
    return isinstance(logger, WandbLogger)


class PrivacyRunLogger(Callback):
    """Records the DP settings in every logger and attaches the final privacy ledger to the run.

    * ``on_train_start`` (once σ, q and N are fixed): ``logger.log_hyperparams({key: dp_hyperparameters})``
      for each of the trainer's loggers, so a W&B run's config holds ``dp.noise_multiplier``,
      ``dp.sample_rate``, ``dp.max_grad_norm``, ``dp.delta``, ``dp.target_epsilon``, ...
    * ``on_fit_end`` (rank 0): the ledger as ``privacy_ledger.json``: for a :class:`WandbLogger` a
      ``wandb.Artifact`` of type ``"privacy-ledger"`` (metadata: ε, δ, steps, run id, hash head) and a copy among
      the run's files (``files/privacy_ledger.json`` of the run directory), and for
      any logger with a ``log_dir`` a copy of the file there. The run's summary also gets the final
      ``epsilon`` (the ledger's, PLD/RDP as configured).

    Use it beside :class:`~lightning_dpzero.PrivacyAccountantCallback` (which logs ε etc. per step).

    Args:
        key: name under which the settings are logged (``None``: top level, unprefixed).
        artifact_name: W&B artifact name; default ``privacy-ledger-<wandb run id>``.

    Raises:
        TypeError: the trainer's strategy is not a DP strategy.

    Example:
        >>> from lightning_dpzero import PrivacyAccountantCallback
        >>> callbacks = [PrivacyAccountantCallback(target_epsilon=8.0), PrivacyRunLogger(key="dp")]
        >>> callbacks[1].logged_hparams is None  # filled when training starts
        True
    """

    def __init__(self, key: Optional[str] = "dp", artifact_name: Optional[str] = None) -> None:
        self.key, self.artifact_name = key, artifact_name
        self.logged_hparams: Optional[dict[str, Any]] = None
        self.ledger_paths: list[Path] = []

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        _mechanism(trainer.strategy, "PrivacyRunLogger")
        params = dp_hyperparameters(trainer)
        self.logged_hparams = params
        payload = {self.key: params} if self.key else params
        for logger in trainer.loggers:
            logger.log_hyperparams(payload)

    @override
    def on_fit_end(self, trainer, pl_module) -> None:
        ledger = getattr(trainer.strategy, "ledger", None)
        if ledger is None:
            return
        self._attach(trainer, ledger)

    @rank_zero_only
    def _attach(self, trainer, ledger) -> None:
        plan = trainer.strategy.plan
        epsilon = ledger.epsilon()
        meta = {"epsilon": None if math.isinf(epsilon) else epsilon, "delta": ledger.delta, "steps": ledger.steps,
                "dataset_size": ledger.dataset_size, "accountant": ledger.accountant, "run_id": ledger.run_id,
                "hash_head": ledger.head,
                "target_epsilon": plan.target_epsilon if plan is not None else None}
        for logger in trainer.loggers:
            if _is_wandb_logger(logger):
                self._to_wandb(logger, ledger, meta)
                continue
            log_dir = getattr(logger, "log_dir", None)
            if log_dir:
                path = Path(log_dir) / LEDGER_FILE
                path.parent.mkdir(parents=True, exist_ok=True)
                ledger.save(path)
                self.ledger_paths.append(path)

    def _to_wandb(self, logger, ledger, meta: dict) -> None:
        import wandb

        run = logger.experiment
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / LEDGER_FILE
            ledger.save(path)
            artifact = wandb.Artifact(self.artifact_name or f"privacy-ledger-{run.id}", type=LEDGER_ARTIFACT_TYPE,
                                      description="DP-SGD privacy ledger (lightning-dpzero): runs of (q, sigma, "
                                                  "steps) with a hash chain; epsilon is recomputed from it.",
                                      metadata=meta)
            artifact.add_file(str(path), name=LEDGER_FILE)
            run.log_artifact(artifact)  # add_file copied the file into the artifact's staging area
        # and among the run's own files (uploaded with it): an offline run directory then holds its ledger
        # whatever becomes of wandb's staging area (lightning-dpzero wandb-summary reads either)
        run_dir = getattr(run, "dir", None)
        if run_dir:
            ledger.save(Path(run_dir) / LEDGER_FILE)
            self.ledger_paths.append(Path(run_dir) / LEDGER_FILE)
        run.summary["final_epsilon"] = meta["epsilon"]
        run.summary["final_dp_steps"] = meta["steps"]


def ledger_json(trainer) -> Optional[str]:
    """The trainer's current privacy ledger as the JSON text ``privacy_ledger.json`` holds (None before fit)."""
    ledger = getattr(trainer.strategy, "ledger", None)
    return None if ledger is None else ledger.to_json()
