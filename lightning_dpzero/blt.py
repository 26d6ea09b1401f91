"""Correlated noise with a buffered linear Toeplitz (BLT) factorization (Dvijotham, McMahan, Pillutla, Steinke,
Thakurta, "Efficient and Near-Optimal Noise Generation for Streaming Differential Privacy", FOCS 2024).

The run releases ``g_t + ν_t`` with ``ν = C⁻¹ z`` for the BLT ``C`` (``c_0 = 1``, ``c_k = Σ_i ω_i θ_i^(k-1)``;
:class:`~lightning_dpzero.accounting.blt.BLTParams`), ``z_t ~ N(0, σ² C_clip² I)`` i.i.d. Where banded MF keeps
the last b - 1 noise vectors, a BLT keeps d state vectors whatever the length of its memory:

    ν_t = z_t − Σ_i ω_i s_{i,t},        s_{i,t+1} = θ_i s_{i,t} + ν_t        (s_{i,0} = 0),

so that ``(C ν)_t = ν_t + Σ_{s<t} c_{t-s} ν_s = z_t``. Memory per rank: d × the rank's optimizer partition, fp32.

Privacy: with cyclic sampling over b parts (every example at most once every b steps), T steps are one Gaussian
mechanism of sensitivity ``Δ_T · C_clip`` (:func:`~lightning_dpzero.accounting.blt.blt_sensitivity`), no
amplification by sampling claimed; σ is calibrated to that (docs/how-to/correlated-noise.md).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from .accounting.blt import BLTParams, optimize_blt

__all__ = ["BLTParams", "optimize_blt", "BLTNoiseSource", "check_blt_supported"]


def check_blt_supported(bands: int) -> None:
    """Refuse a BLT whose cyclic sampling has ``bands`` < 2 parts: with every example eligible at every step, the
    optimal factorization is C = I (DP-SGD without its amplification by sampling), strictly worse than DP-SGD."""
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 2:
        raise ValueError(f"noise_mechanism='blt' needs bands=b >= 2, the number of cyclic parts (an example takes "
                         f"part at most once every b steps), got bands={bands!r}. A good b is the steps per epoch "
                         "(the whole part each step); with b = 1 use noise_mechanism='dp-sgd'.")


class BLTNoiseSource:
    """A noise source (the interface of :class:`lightning_dpzero.noise.NoiseSource`) drawing BLT noise ``ν_t`` in
    units of the standard deviation, ``z_t`` from ``base``: :meth:`begin_step` once per optimizer step, then
    :meth:`normal` once per parameter of the rank's partition, in the optimizer's fixed order.

    Args:
        base: the i.i.d. source of ``z`` (seeded or secure; partitioned or replicated as DP-SGD's).
        params: the BLT's θ and ω, or a function returning them at the first step (a source installed with the
            optimizer, before the plan has optimised them).

    Raises:
        RuntimeError: the parameters or their order changed between steps (the state is per parameter).

    Example:
        >>> from lightning_dpzero.noise import NoiseSource
        >>> params = BLTParams((0.5,), (0.25,))
        >>> src = BLTNoiseSource(NoiseSource(0, False, replicated=True, rank=0), params)
        >>> nu = []
        >>> for _ in range(3):
        ...     src.begin_step(); nu.append(src.normal((4,), "cpu"))
        >>> ref = NoiseSource(0, False, replicated=True, rank=0); z = torch.stack([ref.normal((4,), "cpu") for _ in range(3)])
        >>> c = torch.tensor(params.matrix(3), dtype=torch.float32)
        >>> bool(torch.allclose(c @ torch.stack(nu), z, atol=1e-6))
        True
    """

    def __init__(self, base, params: Union[BLTParams, Callable[[], BLTParams]]):
        self.base, self._params = base, params
        self.secure_mode, self.replicated, self.rank = base.secure_mode, base.replicated, base.rank
        self.state: list[torch.Tensor] = []  # per parameter: (d, *shape) fp32
        self.step = 0                        #: optimizer steps noised so far
        self._index: Optional[int] = None
        self._on_device: dict = {}  # device -> (ω, θ) tensors

    def _weights(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """ω and θ as fp32 tensors on ``device``, made once per device (not per parameter and step)."""
        found = self._on_device.get(device)
        if found is None:
            found = self._on_device[device] = (torch.tensor(self.params.omega, dtype=torch.float32, device=device),
                                               torch.tensor(self.params.theta, dtype=torch.float32, device=device))
        return found

    @property
    def params(self) -> BLTParams:
        if not isinstance(self._params, BLTParams):
            self._params = self._params()
        return self._params

    def begin_step(self) -> None:
        """A new optimizer step."""
        self._index = 0
        self.step += 1

    def normal(self, shape, device) -> torch.Tensor:
        if self._index is None:
            self.begin_step()
        i, self._index = self._index, self._index + 1
        z = self.base.normal(shape, device)
        if i == len(self.state) and self.step == 1:  # the first step: a zero state per parameter
            self.state.append(torch.zeros((self.params.buffers, *z.shape), dtype=torch.float32, device=z.device))
        if i >= len(self.state) or self.state[i].shape[1:] != z.shape:
            raise RuntimeError("BLT noise: the optimizer's parameters changed between steps (the noise state is "
                               "per parameter of a fixed partition); correlated noise needs the same parameters, in "
                               "the same order, at every step.")
        s = self.state[i]
        if s.device != z.device:  # loaded from a checkpoint on the CPU: onto the partition's device, once
            s = self.state[i] = s.to(z.device)
        omega, theta = self._weights(s.device)
        shape_d = (-1,) + (1,) * z.dim()
        omega, theta = omega.view(shape_d), theta.view(shape_d)
        nu = z.float() - (omega * s).sum(0)
        s.mul_(theta).add_(nu.unsqueeze(0))
        return nu.to(z.dtype)

    # ----------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        """What a checkpoint of this rank holds to continue the noise exactly: mechanism, θ, ω, their digest, the
        step and the d state vectors of each parameter (on CPU)."""
        return {"noise_mechanism": "blt", "theta": list(self.params.theta), "omega": list(self.params.omega),
                "digest": self.params.digest(), "step": self.step, "state": [s.detach().cpu() for s in self.state]}

    def load_state_dict(self, state: dict, device=None) -> None:
        """Continue from :meth:`state_dict`. ``ValueError`` if the checkpoint's mechanism or parameters differ."""
        saved = (state.get("noise_mechanism"), state.get("digest"))
        if saved != ("blt", self.params.digest()):
            raise ValueError(f"The checkpoint's noise was noise_mechanism={saved[0]!r} with other coefficients; this "
                             "run has noise_mechanism='blt' with the ledger's θ, ω. Changing the mechanism or its "
                             "coefficients on resume is not covered by the privacy analysis: resume with the "
                             "checkpoint's settings.")
        self.step = int(state["step"])
        self.state = [s.to(device) if device is not None else s.clone() for s in state["state"]]
        self._index = None
