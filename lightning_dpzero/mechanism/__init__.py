"""One DP step, owned by one object (docs/design.md, *The mechanism* and *Where each piece runs*).

:class:`DPMechanism` holds everything that makes an optimizer step private and nothing about what drives the
training loop: the privacy plan, the ledger (opened, restored, charged before the update, I4), the factors on
the loss (the loss probe, *The factors on the loss*), the noise hook and its scales (I3), the non-finite-loss
policy, empty Poisson batches, fresh random streams after a resume, and the check that the noise ran before an
update was applied. It talks to the other ranks through :class:`~lightning_dpzero.util.collectives.Collectives`,
which every Lightning strategy is, so the same object serves the Trainer's :class:`DPDeepSpeedStrategy`, a
Fabric loop, or a loop in plain PyTorch (the audit).

A driver calls, in this order:

1. :meth:`attach` once the per-example engine is attached to the module, at every fit (draws a seed shared by
   the ranks; a fit that continues the ledger derives its streams' seed from the ledger's position);
2. :meth:`install_noise` on the optimizer whose ``step`` receives the reduced gradient;
3. :meth:`private_loader` and :meth:`fix_plan` once the training loader is known (or :meth:`use_plan`
   with a plan of its own); the ledger is opened there, or the restored one continued;
4. optionally :meth:`begin_fit` with the driver's step counters before the first update;
5. per micro-batch, :meth:`training_step` around the forward (its all-reduce also carries a stop that
   :meth:`request_stop` asked for: :attr:`stop_agreed`) and :meth:`probe_loss` on the loss before backward;
6. per optimizer step, :meth:`optimizer_step` around the step;
7. :meth:`resume` when a checkpoint is loaded (:meth:`restore_ledger` for another copy of its ledger).

The accountant callback hands its settings over with :meth:`use_accounting` and reads :attr:`plan`,
:attr:`ledger` and :meth:`take_stats`.

The class is split by concern: ``loss.py`` (the loss probe and the non-finite-loss stop, *The factors on the
loss*), ``data.py`` (the private loader, the plan and the ledger it opens), ``core.py`` (the rest: noise, resume,
the step). ``DPMechanism`` is the one class drivers use.
"""

from .core import DPMechanism, StepStats
from .loss import NonFiniteLossError

__all__ = ["DPMechanism", "NonFiniteLossError", "StepStats"]
