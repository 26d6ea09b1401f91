"""That every update is counted once by everyone who counts it: the ledger and each driver's step counter.

The ledger charges one step per update (I4). The driver counts updates too (Lightning's ``global_step``,
DeepSpeed's ``global_steps``), and the checkpoint check compares the ledger with them. When the accumulation
windows of the driver and of DeepSpeed drift apart, an update holds micro-batches of two Poisson draws and the
counters disagree; :class:`StepCounts` stops training before such an update is applied
(docs/design.md, *Where each piece runs*: step). And every update is charged: :class:`ChargedUpdates` refuses an
update of the noised optimizer outside a charged step, or a second one of a parameter inside it.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch


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


class ChargedUpdates:
    """Which parameters the noised optimizer may update now: none outside a charged optimizer step (from the ledger
    charge to the end of the step), each once inside one. :meth:`check` is the noise hook's first act, so a refused
    update changes nothing. ZeRO-3 steps its base optimizer once per parameter sub-group, each with its own.

    Example:
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        >>> updates = ChargedUpdates()
        >>> updates.open(); updates.check(optimizer); updates.close()
        >>> updates.check(optimizer)
        Traceback (most recent call last):
        ...
        RuntimeError: The optimizer that receives the DP noise was stepped outside the DP strategy's optimizer step...
    """

    def __init__(self) -> None:
        self._updated: Optional[set[int]] = None  # ids of the parameters updated since the charge; None: no step

    def open(self) -> None:
        """The step was charged: its updates may follow."""
        self._updated = set()

    def close(self) -> None:
        """The step ended."""
        self._updated = None

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse (``RuntimeError``) a step of ``optimizer`` outside a charged step (e.g. ``optimizer.optimizer.
        step()`` in a Fabric loop: an update no ledger entry covers), or that updates a parameter a second time
        within one (the same gradient released twice under one charge)."""
        params = [id(p) for group in optimizer.param_groups for p in group["params"]]
        if self._updated is None:
            raise RuntimeError(
                "The optimizer that receives the DP noise was stepped outside the DP strategy's optimizer step "
                "(e.g. optimizer.optimizer.step() in a Fabric loop, or a step of the optimizer DeepSpeed wraps): "
                "that update would not be charged to the privacy ledger. Call optimizer.step() on the optimizer "
                "that fabric.setup returned (or let Lightning's loop step it). Nothing was applied.")
        if self._updated.intersection(params):
            raise RuntimeError(
                "The optimizer that receives the DP noise was stepped twice within one charged optimizer step: the "
                "same gradient would be released twice under one privacy ledger entry. Nothing more was applied.")
        self._updated.update(params)
