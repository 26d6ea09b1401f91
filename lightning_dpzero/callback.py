"""``PrivacyAccountantCallback``: calibrates σ from a target ε, logs the spend, keeps the ledger (DESIGN §5)."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import Callback

from .accounting import EpsilonTracker, PrivacyLedger


class PrivacyAccountantCallback(Callback):
    """Privacy accounting for a :class:`DPDeepSpeedStrategy` run.

    Args:
        target_epsilon: ε budget. If given, σ is calibrated before the first step so that ε(σ) over the
            planned steps is at most this (and within 1% of it); an explicit σ that exceeds it is an error.
        delta: δ of the (ε, δ) guarantee (default 1e-5; keep it well below 1/N).
        accountant: ``"pld"`` (privacy loss distributions, tight; default) or ``"rdp"`` (Rényi DP).

    After every optimizer step it logs ``epsilon``, ``delta``, ``noise_multiplier``, ``sample_rate`` and
    ``dp_steps`` (plus ``clip_fraction`` and ``mean_grad_norm``) with ``self.log``, so any Lightning logger
    records them. Its state (saved in every checkpoint) is the ledger.

    Raises:
        TypeError: the trainer's strategy is not a DPDeepSpeedStrategy.
        ValueError: bad target_epsilon / delta / accountant.
    """

    def __init__(self, target_epsilon: Optional[float] = None, delta: float = 1e-5, accountant: str = "pld"):
        if target_epsilon is not None and not target_epsilon > 0:
            raise ValueError(f"target_epsilon must be > 0, got {target_epsilon!r}.")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}; typical is 1e-5 or below 1/N.")
        if accountant not in ("pld", "rdp"):
            raise ValueError(f"accountant={accountant!r}; use 'pld' or 'rdp'.")
        self.target_epsilon, self.delta, self.accountant = target_epsilon, delta, accountant
        self._tracker = EpsilonTracker()
        self._logged_steps = -1
        self._strategy = None

    @property
    def state_key(self) -> str:
        return "PrivacyAccountantCallback"

    def setup(self, trainer, pl_module, stage: str) -> None:
        from .strategy import DPDeepSpeedStrategy

        if not isinstance(trainer.strategy, DPDeepSpeedStrategy):
            raise TypeError(f"PrivacyAccountantCallback needs a DP strategy (e.g. strategy='dp_deepspeed_stage_3'), "
                            f"got {type(trainer.strategy).__name__}.")
        self._strategy = trainer.strategy
        trainer.strategy.accountant_callback = self

    @property
    def ledger(self) -> Optional[PrivacyLedger]:
        return self._strategy.ledger if self._strategy is not None else None

    def epsilon(self, exact: bool = True) -> float:
        """ε spent so far at this callback's δ (0.0 before the first step)."""
        ledger = self.ledger
        if ledger is None or ledger.steps == 0:
            return 0.0
        return self._tracker.epsilon(ledger, exact=exact)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ledger, strategy = self.ledger, self._strategy
        if ledger is None or ledger.steps == self._logged_steps:
            return
        self._logged_steps = ledger.steps
        plan = strategy.plan
        stats = strategy.per_sample.stats
        metrics = {
            "epsilon": self.epsilon(exact=False),
            "delta": self.delta,
            "noise_multiplier": plan.noise_multiplier,
            "sample_rate": plan.sample_rate,
            "dp_steps": float(ledger.steps),
        }
        if stats["examples"]:
            metrics["clip_fraction"] = stats["clipped"] / stats["examples"]
            metrics["mean_grad_norm"] = stats["norm_sum"] / stats["examples"]
        strategy.per_sample.reset_stats()
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=name == "epsilon",
                          batch_size=1, sync_dist=False)

    def state_dict(self) -> dict[str, Any]:
        ledger = self.ledger
        return {"ledger": ledger.to_dict() if ledger is not None else None, "delta": self.delta,
                "target_epsilon": self.target_epsilon, "accountant": self.accountant}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("ledger")
        if saved is None or self._strategy is None:
            return
        ledger = PrivacyLedger.from_dict(saved)
        restored = self._strategy._restored_ledger
        if restored is not None and restored != ledger:
            raise ValueError("The callback's ledger and the checkpoint's ledger disagree; refusing to resume.")
        self._strategy._restored_ledger = ledger
