"""Empirical privacy auditing in one training run: a sanity check of the accountant, not a proof of privacy.

The method is the one-run audit of Steinke, Nasr and Jagielski ("Privacy Auditing with One (1) Training Run",
NeurIPS 2023). m *canary* examples are each included in the training set independently with probability 1/2;
after one DP-SGD training run every canary gets a score (how much the trained model moved towards it), and the
auditor guesses "included" for the k+ highest scores and "excluded" for the k- lowest, abstaining on the rest.
If training is (ε, δ)-DP with respect to adding or removing one example, the number W of correct guesses among
the r = k+ + k- made is, by their main theorem, at most a Binomial(r, e^ε / (1 + e^ε)) variable plus a δ term:

    P[W >= v] <= P[Bin(r, p_ε) >= v] + 2 m δ · max_{1 <= i <= v} P[v - i <= Bin(r, p_ε) < v] / i,

    p_ε = e^ε / (1 + e^ε).

An observed v therefore rejects, at confidence 1 - β, every ε whose right-hand side is below β; the largest such
ε is an empirical *lower* bound on the ε the training really has. A correct accountant must report at least that
much (up to the 1 - β confidence). A lower bound far below the accountant's ε says nothing either way (auditing
DP-SGD from the last model only is known to be loose); a lower bound *above* it means a bug in the noise, the
clipping, the sampling or the accounting.

:func:`audit_one_run` trains a small model in plain PyTorch with the package's own mechanism (the
:class:`~lightning_dpzero.mechanism.DPMechanism` that the strategy drives: the
:class:`~lightning_dpzero.PerSampleEngine` for per-example clipping, the noise hook on the optimizer adding
Gaussian noise to the summed clipped gradients and dividing by the expected batch q·N, the
:class:`~lightning_dpzero.DistributedPoissonBatchSampler`, the privacy ledger for ε), so it runs on a CPU in
seconds. :func:`dirac_canaries` builds canaries that make the audit strong for a linear first layer.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

import numpy as np
import torch
from torch import nn

from .util.options import Clipping, check_option
from .mechanism import DPMechanism
from .per_sample import PerSampleEngine
from .accounting.plan import PrivacyPlan
from .sampling.samplers import DistributedPoissonBatchSampler

__all__ = ["AuditResult", "audit_one_run", "dirac_canaries", "epsilon_lower_bound", "p_value"]


def _binomial_pmf(r: int, p: float) -> np.ndarray:
    """pmf of Binomial(r, p) at 0..r, from log-gamma (stable for r in the thousands)."""
    k = np.arange(r + 1, dtype=np.float64)
    if p <= 0.0 or p >= 1.0:
        out = np.zeros(r + 1)
        out[0 if p <= 0.0 else r] = 1.0
        return out
    lg = np.vectorize(math.lgamma)
    log_pmf = lg(r + 1.0) - lg(k + 1.0) - lg(r - k + 1.0) + k * math.log(p) + (r - k) * math.log1p(-p)
    return np.exp(log_pmf)


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[at least v of r guesses correct] when training is (ε, δ)-DP, m canaries (see module doc).

    Raises:
        ValueError: unless 0 <= v <= r <= m, ε >= 0 and 0 <= δ <= 1.
    """
    if not (isinstance(m, (int, np.integer)) and 0 <= v <= r <= m):
        raise ValueError(f"need integers 0 <= v <= r <= m, got m={m!r}, r={r!r}, v={v!r}.")
    if not (epsilon >= 0 and 0 <= delta <= 1):
        raise ValueError(f"need ε >= 0 and δ in [0, 1], got ε={epsilon!r}, δ={delta!r}.")
    pmf = _binomial_pmf(int(r), 1.0 / (1.0 + math.exp(-epsilon)) if epsilon < 700 else 1.0)
    tail = float(pmf[v:].sum())
    if delta == 0 or v == 0:
        return min(1.0, tail)
    # below[i-1] = P[v - i <= Bin < v] for i = 1..v
    below = np.cumsum(pmf[:v][::-1])
    alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95,
                        tolerance: float = 1e-4) -> float:
    """The largest ε that ``v`` correct guesses out of ``r`` (``m`` canaries) reject at ``confidence``.

    Returns 0.0 when even ε = 0 is not rejected. Bisection to ``tolerance``, rounded down (conservative).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}.")
    beta = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < beta:
        lo, hi = hi, 2.0 * hi
        if hi > 512:
            return lo  # every ε this side of numerical overflow is rejected
    while hi - lo > tolerance:
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) < beta:
            lo = mid
        else:
            hi = mid
    return lo


def dirac_canaries(m: int, num_features: int, num_classes: int, scale: float = 10.0,
                   generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """m canaries for a model whose first layer is linear over ``num_features + m`` inputs: canary i is
    ``scale`` on its own input coordinate ``num_features + i`` (zero elsewhere) with a random label.

    The training data must be padded with m zero columns (``torch.nn.functional.pad(x, (0, m))``); then canary i's
    gradient in a bias-free first layer lives in its own weight column only, so the canaries do not interfere and
    the white-box alignment score sees each one separately (the strongest audit a one-run audit can do).
    """
    x = torch.zeros(m, num_features + m)
    x[torch.arange(m), num_features + torch.arange(m)] = float(scale)
    y = torch.randint(0, num_classes, (m,), generator=generator)
    return x, y


@dataclass
class AuditResult:
    """Outcome of :func:`audit_one_run`.

    Attributes:
        epsilon_lower_bound: empirical lower bound on ε at ``delta``, valid with probability ``confidence``.
        epsilon: the accountant's ε (an upper bound, from the privacy ledger of the run) at ``delta``.
        delta, confidence: of both numbers.
        canaries, guesses, correct: m, r = k+ + k-, and v.
        steps, sample_rate, noise_multiplier: the run.
        included: which canaries were in the training set; scores: their scores.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> g = torch.Generator().manual_seed(0)
        >>> m = 20  # canaries, each on its own input coordinate of a bias-free linear layer
        >>> x, y = nn.functional.pad(torch.randn(100, 4, generator=g), (0, m)), torch.randint(0, 2, (100,), generator=g)
        >>> result = audit_one_run(nn.Linear(4 + m, 2, bias=False), (x, y), dirac_canaries(m, 4, 2, generator=g),
        ...                        steps=5, sample_rate=0.5, noise_multiplier=1.0, generator=g)
        >>> result.guesses, result.steps, result.consistent
        (2, 5, True)
    """

    epsilon_lower_bound: float
    epsilon: float
    delta: float
    confidence: float
    canaries: int
    guesses: int
    correct: int
    steps: int
    sample_rate: float
    noise_multiplier: float
    included: torch.Tensor = field(repr=False)
    scores: torch.Tensor = field(repr=False)

    @property
    def consistent(self) -> bool:
        """The empirical lower bound does not exceed the accountant's ε."""
        return self.epsilon_lower_bound <= self.epsilon


def _per_example_loss(loss_fn, model, x, y):
    out = loss_fn(model(x), y, reduction="none")
    return out.reshape(len(x), -1).mean(1)


def _scores(kind, initial, final, cx, cy, loss_fn):
    """Canary scores: "alignment" (white box: how far θ_T - θ_0 moved along each canary's descent direction at
    θ_0) or "loss" (black box: the drop of each canary's loss)."""
    initial, final = initial.eval(), final.eval()
    if kind == "loss":
        with torch.no_grad():
            return _per_example_loss(loss_fn, initial, cx, cy) - _per_example_loss(loss_fn, final, cx, cy)
    names = [n for n, p in initial.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in initial.named_parameters() if p.requires_grad}
    moved = {n: dict(final.named_parameters())[n].detach() - params[n] for n in names}

    def one(p, x, y):
        out = torch.func.functional_call(initial, p, (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    grads = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))(params, cx, cy)
    dot = sum((grads[n] * moved[n].unsqueeze(0)).flatten(1).sum(1) for n in names)
    norm = torch.sqrt(sum(grads[n].flatten(1).pow(2).sum(1) for n in names)).clamp_min(1e-12)
    return -dot / norm


def audit_one_run(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor],
                  canaries: tuple[torch.Tensor, torch.Tensor], *, steps: int, sample_rate: float,
                  noise_multiplier: float, max_grad_norm: float = 1.0, lr: float = 1.0, delta: float = 1e-5,
                  guesses: Optional[tuple[int, int]] = None, confidence: float = 0.95,
                  score: Literal["alignment", "loss"] = "alignment", clipping: Clipping = "all-layer",
                  loss_fn: Callable = nn.functional.cross_entropy,
                  generator: Optional[torch.Generator] = None) -> AuditResult:
    """Train ``model`` once with DP-SGD on ``data`` plus a random half of ``canaries``; audit ε empirically.

    Args:
        model: a module with supported layers only (it is trained in place).
        data: (x, y) of the non-canary training examples.
        canaries: (x, y) of the m canaries (e.g. :func:`dirac_canaries`).
        steps: number of DP-SGD steps. The run is DP-SGD with Poisson sampling at rate q over all included
            examples, per-example clipping to C (``clipping``), Gaussian noise σC on the sum, divided by the
            expected batch q·(N + m/2) (fixed before the canaries are drawn), and plain SGD.
        sample_rate: q, the Poisson sampling rate.
        noise_multiplier: σ.
        max_grad_norm: C, the clipping threshold.
        lr: the SGD learning rate.
        delta: δ of both the accountant's ε and the lower bound.
        guesses: (k+, k-): "included" for the k+ highest scores, "excluded" for the k- lowest; default m/20 each.
        confidence: of the lower bound (default 0.95).
        score: "alignment" (white box, default) or "loss" (black box).
        clipping: the clipping style passed to the per-example engine, ``"all-layer"`` (default) or ``"layer-wise"``.
        loss_fn: the loss ``loss_fn(output, y)``, a batch mean that also accepts ``reduction="none"``
            (default cross-entropy).
        generator: randomness of canary inclusion, sampling and noise (seed it for a reproducible audit).

    Returns:
        AuditResult: the empirical lower bound next to the accountant's ε.
    """
    check_option("score", score, Literal["alignment", "loss"])
    x, y = data
    cx, cy = canaries
    m = len(cx)
    if m < 1:
        raise ValueError("audit_one_run needs at least one canary.")
    k_plus, k_minus = guesses if guesses is not None else (max(1, m // 20), max(1, m // 20))
    if not (0 <= k_plus and 0 <= k_minus and 0 < k_plus + k_minus <= m):
        raise ValueError(f"guesses={guesses!r}: need k+, k- >= 0 with 0 < k+ + k- <= m = {m}.")
    gen = generator if generator is not None else torch.Generator().manual_seed(int(torch.randint(2**62, (1,))))

    included = torch.rand(m, generator=gen) < 0.5
    train_x = torch.cat([x, cx[included]])
    train_y = torch.cat([y, cy[included]])
    n_total = len(train_x)
    seed = int(torch.randint(2**62, (1,), generator=gen))  # the noise's and the sampler's streams
    mechanism = DPMechanism(noise_multiplier, max_grad_norm, seed=seed)  # refuses a bad σ
    sampler = DistributedPoissonBatchSampler(n_total, sample_rate, steps_per_epoch=steps, seed=seed)  # a bad q
    initial = copy.deepcopy(model)
    mechanism.attach(PerSampleEngine(model, max_grad_norm=max_grad_norm, clipping=clipping).attach())
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    mechanism.install_noise(optimizer, replicated=True)
    # the divisor q·(N + m/2) is fixed before the canaries are drawn (data-independent)
    mechanism.use_plan(PrivacyPlan(dataset_size=n_total, sample_rate=sample_rate,
                                   expected_batch_size=sample_rate * (len(x) + m / 2),
                                   noise_multiplier=float(noise_multiplier), delta=delta, planned_steps=steps,
                                   sampler_kind="poisson"))

    def step(charged_closure):
        charged_closure()  # clipped per-example gradients, then the ledger charge: before the update
        optimizer.step()   # the noise hook first: (Σ clip(g_i) + σ·C·z) / B_exp, then SGD

    model.train()
    try:
        for t, idx in enumerate(sampler, 1):
            optimizer.zero_grad(set_to_none=True)

            def closure(idx=idx, t=t):
                if idx:  # an empty Poisson batch releases the noise alone
                    loss = mechanism.training_step(lambda: loss_fn(model(train_x[idx]), train_y[idx]), len(idx),
                                                   step=t)
                    mechanism.probe_loss(loss).backward()

            mechanism.optimizer_step(step, closure, boundary=True, step_applied=lambda: True)
    finally:
        mechanism.detach()
    scores = _scores(score, initial, model, cx, cy, loss_fn).detach()

    order = torch.argsort(scores, descending=True)
    guessed_in, guessed_out = order[:k_plus], order[len(order) - k_minus:] if k_minus else order[:0]
    correct = int(included[guessed_in].sum()) + int((~included[guessed_out]).sum())
    r = k_plus + k_minus
    eps = mechanism.ledger.epsilon() if noise_multiplier > 0 else math.inf
    return AuditResult(epsilon_lower_bound=epsilon_lower_bound(m, r, correct, delta, confidence), epsilon=eps,
                       delta=delta, confidence=confidence, canaries=m, guesses=r, correct=correct, steps=steps,
                       sample_rate=sample_rate, noise_multiplier=noise_multiplier, included=included,
                       scores=scores)
