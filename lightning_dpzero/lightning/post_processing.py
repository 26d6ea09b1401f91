"""A second model trained only on what the private one releases: a DP-GAN's generator, trained through the
differentially private discriminator (docs/how-to/dp-gan.md; docs/privacy.md, *Post-processing models*).

The private model (the discriminator) is the one model whose steps see the private data: each of its steps is a DP
step, charged once with its own Poisson-sampled batch. A model marked with :func:`post_processing` and set up with
its own optimizer beside it (``fabric.setup(post_processing(generator), optimizer)``) is trained on gradients that
flow through the private model's *released* parameters, applied to data the post-processing model generates from
public randomness: each of its updates is a function of released values and public randomness only, post-processing
of the DP steps, so it is not charged (Dwork & Roth 2014, Prop. 2.1). :class:`PostProcessing` enforces the
structure that argument needs, before any update it would break is applied:

* the private model's forwards between a draw and its step are private (per-example sites); at most one of them
  per step runs on anything but the post-processing models' output of the step (the drawn batch), the others on
  generated rows, one per example of the batch, which each example's clipped gradient then includes (a generated
  sample paired with an example, drawn independently of the data: the bound C per example holds);
* a private backward gives no gradient to a post-processing parameter (the generated samples must be detached in
  the private model's loss);
* after the private step (and before the next draw) the private model's forwards are public: they run without the
  engine, its parameters frozen (a post-processing backward updates nothing of it), and none may read a tensor of
  the drawn batch; a post-processing backward that reaches a private forward's per-example site is refused;
* a post-processing model's ``optimizer.step()`` charges nothing.

What the library cannot see: a private tensor copied into the public phase by the loop's own code (a statistic of
the batch used in the generator's loss). The generator's loss must be computed from the released model and
generated data only (docs/how-to/dp-gan.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_MARK = "_dp_post_processing"


def post_processing(module: nn.Module) -> nn.Module:
    """Mark ``module`` as trained only by post-processing of the private model (a DP-GAN's generator): set it up
    with its own optimizer, ``fabric.setup(post_processing(generator), generator_optimizer)``, beside the private
    model. Its steps are not charged; what it may read is checked as the loop runs (``post_processing.py``).

    Returns:
        ``module`` itself.

    Example:
        >>> from torch import nn
        >>> from lightning_dpzero import post_processing
        >>> generator = post_processing(nn.Linear(4, 8))
        >>> is_post_processing(generator)
        True
    """
    setattr(module, _MARK, True)
    return module


def is_post_processing(module: nn.Module) -> bool:
    """Whether :func:`post_processing` marked ``module``."""
    return bool(getattr(module, _MARK, False))


def _row_prints(t: torch.Tensor) -> torch.Tensor:
    """Each row's sum and sum of squares in float64 ``(n, 2)``: how a generated row is recognised (after a dtype
    conversion too)."""
    rows = t.detach().double().reshape(t.shape[0], -1)
    return torch.stack([rows.sum(1), rows.pow(2).sum(1)], 1)


class PostProcessing:
    """The post-processing models of a DP Fabric run and the phase of the private model (see the module)."""

    def __init__(self) -> None:
        self.engines: list[Any] = []  # the post-processing models' DeepSpeed engines (their optimizers step them)
        self.engine = None            # the private model's per-example engine
        self._handles: list = []
        self._frozen: list[torch.nn.Parameter] = []
        self._generated: list[torch.Tensor] = []  # row prints of the post-processing models' outputs of this step
        self._drawn: set[int] = set()             # storages of the tensors of the step's drawn batch
        self.private_backward = False

    @property
    def active(self) -> bool:
        return bool(self.engines)

    def add(self, deepspeed_engine, module: nn.Module) -> None:
        """A post-processing model set up: its engine, a guard on each of its trainable parameters, and a hook
        that records what its forwards generate."""
        self.engines.append(deepspeed_engine)
        for name, p in module.named_parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._guard(name)))
        self._handles.append(deepspeed_engine.register_forward_hook(self._record))

    def owns(self, engine_or_optimizer) -> bool:
        """Whether it is a post-processing model's DeepSpeed engine or that engine's optimizer (what Fabric hands
        the strategy's ``optimizer_step``)."""
        return any(engine_or_optimizer is e or engine_or_optimizer is e.optimizer for e in self.engines)

    def _guard(self, name: str):
        def check(grad):
            if self.private_backward:
                raise RuntimeError(
                    f"The post-processing model's parameter '{name}' received a gradient in the private model's "
                    "backward: its update would then not be post-processing of the released model. Detach the "
                    "generated samples in the private model's loss (private_model(fake.detach())).")
            return grad
        return check

    def _record(self, module, args, output) -> None:
        from torch.utils._pytree import tree_flatten

        self._generated += [_row_prints(t) for t in tree_flatten(output)[0]
                            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.is_floating_point()]

    # ------------------------------------------------------------------ the phases of a step
    def drawn(self, batch: Any) -> None:
        """A batch was drawn: the private model's next forwards are private (its parameters trainable again)."""
        from torch.utils._pytree import tree_flatten

        self.public(False)
        self._drawn = {t.untyped_storage().data_ptr() for t in tree_flatten(batch)[0]
                       if isinstance(t, torch.Tensor) and t.numel()}

    def stepped(self) -> None:
        """The private step was applied: until the next draw the private model's forwards are public; what the
        post-processing models generate from now on may be paired with the next step's examples."""
        self.public(True)
        self._generated = []

    def public(self, on: bool) -> None:
        """The public phase on (the private model frozen, its engine out of its forwards) or off."""
        if self.engine is None or not self.active or self.engine.public == on:
            return
        self.engine.public = on
        if on:
            self._frozen = [p for p in self.engine.module.parameters() if p.requires_grad]
            for p in self._frozen:
                p.requires_grad_(False)
        else:
            for p in self._frozen:
                p.requires_grad_(True)
            self._frozen = []

    # ------------------------------------------------------------------ checks
    def check_public_forward(self, args: tuple, kwargs: dict) -> None:
        """A forward of the private model in the public phase must not read a tensor of the drawn batch."""
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() in self._drawn:
                raise RuntimeError(
                    "The private model ran, after its step, on a tensor of the batch drawn for that step: a "
                    "post-processing model's loss may use the released private model on generated data only (its "
                    "gradient would otherwise read private examples without clipping or noise). Nothing of it was "
                    "applied. Draw the next batch for the next private step.")

    def is_generated(self, args: tuple, kwargs: dict) -> bool:
        """Every row of the forward's first tensor argument is a row a post-processing model generated this step."""
        from torch.utils._pytree import tree_flatten

        first = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() >= 1),
                     None)
        if first is None or not self._generated or not first.is_floating_point():
            return False
        rows = _row_prints(first)
        known = torch.cat(self._generated)
        tol = 1e-5 if first.dtype in (torch.float32, torch.float64) else 2e-2
        close = torch.isclose(rows[:, None, :], known[None, :, :], rtol=tol, atol=tol).all(-1)  # (n, m)
        return bool(close.any(1).all())

    def close(self) -> None:
        self.public(False)
        for h in self._handles:
            h.remove()
        self._handles = []

