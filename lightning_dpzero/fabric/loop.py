"""Where a Fabric loop meets the DP step: which call may come next, the draws of the private loader, the budget
and the privacy metrics of every step (docs/design.md, *Where each piece runs*: Fabric).

A Fabric user writes the loop, so nothing guarantees what a Lightning ``Trainer`` guarantees by construction:
one Poisson draw per optimizer step, one forward and one backward per draw, on the batch drawn. :class:`FabricSteps`
follows the calls and refuses, before anything of the step is applied, a training forward without exactly one draw
from the private loader since the last step, a training forward whose inputs are not that draw's batch
(:func:`forwards_drawn_batch`: the previous step's batch again, a fixed one, part of it), a second forward or
backward within a step, a step without backward, and a step beyond the privacy budget. (An update applied by the
optimizer inside Fabric's wrapper, bypassing ``optimizer.step()``, is refused by the mechanism's noise hook.) After each step one all-reduce agrees on the budget (rank 0
decides) and sums the clipping statistics; rank 0's answers come from an :class:`~lightning_dpzero.accounting.
background.AccountingAhead` worker that computed them while the step ran, as for the Trainer's callback.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from ..sampling.collate import stand_in_batch
from ..util.collectives import sum_over_ranks
from ..sampling.micro_batch import random_state_kept
from ..util.options import AccountingWorker
from ..lightning.post_processing import PostProcessing
from ..accounting import BudgetGuard, EpsilonTracker, PrivacyBudgetExceeded
from ..accounting.background import AccountingAhead, Answerer, ledger_epsilon

_NOT_DRAWN = (
    "The training forward's inputs are not the batch drawn from the DP loader for this step: no tensor it received "
    "is one of that batch's tensors, as the loader yields them, moved to another device, cast to another dtype, or "
    "a view with the same rows. Training on another batch (the previous step's again, a fixed one, a part of this "
    "one) releases an update the privacy ledger does not charge. Forward the batch you drew (for x, y in loader: "
    "model(x)); transform examples in the Dataset or the DataLoader's collate_fn (the DP loader keeps both), not "
    "between the draw and the forward. Nothing of this step was applied.")

_LOOP = ("The loop of a DP Fabric run is, per optimizer step: draw one batch from the loader that "
         "fabric.setup_dataloaders returned, one training forward of the model, fabric.backward(loss), "
         "optimizer.step() (then optimizer.zero_grad()).")


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors with a batch dimension in ``obj`` (nested tuples, lists, dicts, dataclasses)."""
    from lightning_utilities.core.apply_func import apply_to_collection

    found: list[torch.Tensor] = []
    apply_to_collection(obj, torch.Tensor, lambda t: found.append(t) if t.dim() else None)
    return found


def _of_batch(t: torch.Tensor, drawn: torch.Tensor) -> bool:
    """Whether ``t`` is ``drawn`` with its rows: itself, a view of it (same storage), or its values on another
    device or in another dtype (reshaped)."""
    if t is drawn:
        return True
    if t.shape[0] != drawn.shape[0]:
        return False
    try:
        if t.device == drawn.device and t.untyped_storage().data_ptr() == drawn.untyped_storage().data_ptr():
            return True
    except (RuntimeError, NotImplementedError):  # no storage to compare (a tensor subclass): compare values
        pass
    if t.numel() != drawn.numel():
        return False
    with torch.no_grad():
        return bool(torch.equal(t.detach().reshape(-1), drawn.detach().to(t.device, t.dtype).reshape(-1)))


def forwards_drawn_batch(drawn: list[torch.Tensor], args: tuple, kwargs: dict) -> bool:
    """Whether a training forward called with ``args``/``kwargs`` trains on the batch whose tensors are ``drawn``:
    some tensor it receives is one of them, moved, cast or viewed with the same rows (:func:`_of_batch`). True
    when either holds no tensor (a batch of strings tokenised in the loop, say): there is nothing to compare."""
    received = _tensors((args, kwargs))
    if not drawn or not received:
        return True
    return any(_of_batch(t, d) for t in received for d in drawn)


def _announcing_iter(loader):
    for batch in super(type(loader), loader).__iter__():
        yield loader._dp_steps.drawn(batch, loader)


def announce_draws(loader: DataLoader, steps: "FabricSteps") -> DataLoader:
    """``loader`` itself, its class extended so that each batch it yields is counted (a draw of the sampler):
    Fabric wraps what the strategy returns, so the count must live in the loader."""
    loader.__class__ = type(f"DP{type(loader).__name__}", (type(loader),), {"__iter__": _announcing_iter})
    loader._dp_steps = steps
    return loader


class FabricSteps:
    """The state of the step being built: ``ready`` (a batch may be drawn and forwarded), ``forward`` (the
    training forward ran; backward next), ``backward`` (``optimizer.step()`` next)."""

    def __init__(self, mechanism, target_epsilon: Optional[float], accounting_worker: AccountingWorker = "process",
                 post: Optional[PostProcessing] = None) -> None:
        self.mechanism = mechanism
        self.post = post if post is not None else PostProcessing()  # post-processing models (lightning/post_processing)
        self.batch_forwards = 0  # private forwards of this step on other rows than generated ones
        self.accounting_worker = accounting_worker
        self.target_epsilon = target_epsilon
        self.phase = "ready"
        self.draws = 0
        self.batch_size: Optional[int] = None
        self.stand_in_rows = 0  # > 0: the batch drawn was empty and the loop got its stand-in of that many rows
        self.drawn_tensors: list[torch.Tensor] = []  # the tensors of the batch the loop got at the step's draw
        self.fit_started = False
        self.taken = 0  # optimizer steps taken (charged), over the run's lineage (restored with a checkpoint)
        self.tracker = EpsilonTracker()
        self.guard = BudgetGuard(target_epsilon, self.tracker) if target_epsilon is not None else None
        self.next_step_allowed = True
        self.metrics: dict[str, float] = {}
        self._ahead: Optional[AccountingAhead] = None  # rank 0, from the first decision until teardown

    def start_accounting(self) -> None:
        """Start rank 0's accounting worker (if it is not running)."""
        if self._ahead is None:
            self._ahead = AccountingAhead(Answerer(self.tracker, self.guard, None), self.accounting_worker)

    def close(self) -> None:
        """Stop the accounting worker (it is started again at the next decision)."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def epsilon(self, exact: bool = True) -> float:
        """ε of the ledger (exact by default), asked of the worker while it holds the tracker."""
        return ledger_epsilon(self.mechanism.ledger, self._ahead, self.tracker, exact)

    # ------------------------------------------------------------------ the calls of the user's loop
    def drawn(self, batch: Any, loader: Any = None) -> Any:
        """Count a draw of ``loader`` and return what the loop gets: the batch, or for an empty one its one-row
        stand-in (``_collate.stand_in_batch``; the engine takes no example of it, and its loss becomes 0)."""
        from lightning.pytorch.utilities.data import extract_batch_size

        self.draws += 1
        self.post.drawn(batch)
        try:
            self.batch_size = extract_batch_size(batch)
        except Exception:  # noqa: BLE001 - no tensor found: each layer reads B from its input
            self.batch_size = None
        self.stand_in_rows = 0
        if self.batch_size == 0:
            with random_state_kept(torch.device("cpu")):  # reading the example draws nothing the loop sees
                stand_in = stand_in_batch(loader)
            if stand_in is not None:
                self.stand_in_rows = extract_batch_size(stand_in)
                batch = stand_in
        self.drawn_tensors = _tensors(batch)
        return batch

    def before_forward(self, args: tuple = (), kwargs: Optional[dict] = None) -> str:
        """A training forward (module in training mode, gradients on) of the private model is about to run on
        ``args``/``kwargs``: ``"first"`` (the step's first private forward), ``"more"`` (a further private forward,
        on rows a post-processing model generated this step) or ``"public"`` (after the step, before the next draw,
        with a post-processing model: the engine stays out of it)."""
        if self.post.active and self.phase == "ready" and self.draws == 0:
            self.post.check_public_forward(args, kwargs or {})
            self.post.public(True)  # (before the first draw too)
            return "public"
        if self.mechanism.plan is None:
            raise RuntimeError(
                "A training forward ran before the training DataLoader was set up: pass it through "
                "fabric.setup_dataloaders(train_loader) first (the DP strategy replaces its sampler by Poisson "
                "sampling and fixes the privacy plan and the ledger from it). Nothing was trained.")
        if not self.next_step_allowed:
            raise PrivacyBudgetExceeded(self.exhausted_message() + " Refusing the step (check "
                                        "fabric.strategy.should_stop after each optimizer.step()).")
        generated = self.phase != "backward" and self.post.is_generated(args, kwargs or {})
        if self.phase == "backward" or self.phase == "forward" and not generated and self.batch_forwards:
            raise RuntimeError(
                f"A second training forward of the model {'before fabric.backward' if self.phase == 'forward' else 'before optimizer.step()'}: "
                "each optimizer step of DP training releases one Poisson-sampled batch, clipped per example "
                "over one forward and one backward (several forwards or gradient accumulation in the loop are "
                "not supported; use a larger batch_size; with a post-processing model, further forwards of a "
                f"step run on the rows it generated this step, one per example). {_LOOP}")
        if self.draws != 1:
            got = "no batch" if self.draws == 0 else f"{self.draws} batches"
            raise RuntimeError(
                f"{got} drawn from the DP loader since the last optimizer step: every step must train on exactly "
                "the one Poisson-sampled batch drawn for it (data from elsewhere, or skipped draws, are not what "
                f"the privacy ledger charges). Nothing of this step was applied. {_LOOP}")
        if not generated and not forwards_drawn_batch(self.drawn_tensors, args, kwargs or {}):
            raise RuntimeError(f"{_NOT_DRAWN} {_LOOP}")
        first = self.phase == "ready"
        self.batch_forwards += not generated
        self.phase = "forward"
        return "first" if first else "more"

    def before_backward(self) -> None:
        if self.phase != "forward":
            raise RuntimeError(
                "fabric.backward was called " + ("twice for one training forward" if self.phase == "backward"
                                                 else "without a training forward of the model before it (in "
                                                      "training mode, with gradients on)")
                + f". {_LOOP}")
        self.phase = "backward"

    def before_step(self, kwargs: dict) -> None:
        if "closure" in kwargs:
            raise ValueError("optimizer.step(closure) is not supported with DeepSpeed; call fabric.backward(loss) "
                             "and then optimizer.step().")
        if self.phase != "backward":
            raise RuntimeError(f"optimizer.step() without fabric.backward(loss) since the last step. {_LOOP}")

    def after_step(self) -> None:
        self.phase, self.draws, self.taken, self.batch_forwards, self.drawn_tensors = "ready", 0, self.taken + 1, 0, []
        self.post.stepped()

    # ------------------------------------------------------------------ budget and metrics
    def exhausted_message(self) -> str:
        ledger, plan = self.mechanism.ledger, self.mechanism.plan
        ask = self._ahead if self._ahead is not None else self.guard
        after = ask.epsilon_after_next_step(ledger, plan.sample_rate, plan.noise_multiplier, plan.sampler_kind,
                                            plan.micro_batch_bound)
        return (f"Privacy budget exhausted: after {ledger.steps} optimizer steps one more step (q = "
                f"{plan.sample_rate:.6g}, σ = {plan.noise_multiplier:.6g}) would make ε = {after:.6g} > "
                f"target_epsilon = {self.target_epsilon:g} (δ = {ledger.delta:g}).")

    def decide(self, collectives, device: torch.device, stats: Optional[tuple] = None) -> None:
        """Agree whether the next step fits the budget (rank 0 evaluates it: every rank holds the same ledger)
        and, after a step, sum its clipping statistics, in one all-reduce; set :attr:`metrics`."""
        mechanism = self.mechanism
        ledger, plan = mechanism.ledger, mechanism.plan
        if ledger is None or plan is None:
            return
        refuse = eps = 0.0
        if collectives.global_rank == 0:  # every rank holds the same ledger: rank 0 answers for all
            self.start_accounting()
            answers = self._ahead.answers(ledger, plan.sample_rate, plan.noise_multiplier, plan.sampler_kind,
                                          plan.micro_batch_bound)
            refuse, eps = float(not answers.allows_next_step), answers.epsilon
        local = [float(v) for v in (stats or (0, 0, 0.0))] + [refuse, eps]
        values = torch.tensor(local, dtype=torch.float64, device=device)
        if collectives.world_size > 1:
            values = sum_over_ranks(collectives, values)
        examples, clipped, norm_sum, refuse, eps = values.cpu().tolist()
        self.next_step_allowed = refuse == 0
        self.metrics = {"epsilon": eps, "delta": ledger.delta, "noise_multiplier": plan.noise_multiplier,
                        "sample_rate": plan.sample_rate, "dp_steps": float(ledger.steps)}
        if examples:
            self.metrics["clip_fraction"] = clipped / examples
            self.metrics["mean_grad_norm"] = norm_sum / examples if math.isfinite(norm_sum) else norm_sum
