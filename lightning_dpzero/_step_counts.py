"""That every update is counted once by everyone who counts it: the ledger and each driver's step counter.

The ledger charges one step per update (I4). The driver counts updates too (Lightning's ``global_step``,
DeepSpeed's ``global_steps``), and the checkpoint check compares the ledger with them. When the accumulation
windows of the driver and of DeepSpeed drift apart, an update holds micro-batches of two Poisson draws and the
counters disagree; :class:`StepCounts` stops training before such an update is applied
(docs/design.md, *Where each piece runs*: step).
"""

from __future__ import annotations

from typing import Mapping, Optional


class StepCounts:
    """The counters at the start of a fit, and the check that each advanced by one per charged update.

    Example:
        >>> counts = StepCounts()
        >>> counts.begin(ledger_steps=3, counters={"global_step": 3})
        >>> counts.check(ledger_steps=4, counters={"global_step": 4})  # one update: all advanced by one
        >>> counts.check(ledger_steps=5, counters={"global_step": 4})
        Traceback (most recent call last):
        ...
        RuntimeError: The optimizer-step counters disagree before an update (ledger steps 5 (+2 this fit), ...
    """

    def __init__(self) -> None:
        self._start: Optional[dict[str, int]] = None

    def begin(self, ledger_steps: int, counters: Mapping[str, int]) -> None:
        """The ledger's steps and the drivers' counters before the fit's first update."""
        self._start = {"ledger steps": int(ledger_steps), **{k: int(v) for k, v in counters.items()}}

    def check(self, ledger_steps: int, counters: Mapping[str, int]) -> None:
        """After the charge, before the update (counters with this update included).

        Raises:
            RuntimeError: a counter advanced by another number of steps than the ledger since :meth:`begin`.
        """
        if self._start is None:
            return
        now = {"ledger steps": int(ledger_steps), **{k: int(v) for k, v in counters.items()}}
        advanced = {name: now[name] - self._start.get(name, 0) for name in now}
        if len(set(advanced.values())) > 1:
            raise RuntimeError(
                "The optimizer-step counters disagree before an update ("
                + ", ".join(f"{name} {now[name]} (+{n} this fit)" for name, n in advanced.items())
                + "): the update would not be exactly one charged logical batch. Training stopped before it was "
                "applied. Please report this with the Trainer settings (accumulate_grad_batches, "
                "limit_train_batches, max_steps) and how the run was started or resumed.")
