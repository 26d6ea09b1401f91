"""``nn.Conv2d`` (groups=1, zero padding) as a Linear over unfolded patches (Lee & Kifer 2021, §4).

With ``unfold``, an example's input becomes T = H_out·W_out rows of d = C_in·k_h·k_w values and its output
gradient T rows of p = C_out values, so the Linear rule's ghost-or-instantiate choice applies unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import UnsupportedLayerError
from .linear import LinearRule


def _padding(module: nn.Conv2d):
    if module.padding == "valid":
        return (0, 0)
    if module.padding == "same":
        return tuple(d * (k - 1) // 2 for d, k in zip(module.dilation, module.kernel_size))
    return module.padding


class Conv2dRule(LinearRule):
    """Shares the Linear rule's norms and weighted sums; only the rows differ (unfolded patches)."""

    module_types = (nn.Conv2d,)

    def check(self, module, name):
        if module.groups != 1:
            raise UnsupportedLayerError(
                f"Conv2d '{name}' has groups={module.groups}; grouped convolutions are not supported yet. "
                "Fix: use groups=1.")
        if module.padding_mode != "zeros":
            raise UnsupportedLayerError(
                f"Conv2d '{name}' has padding_mode={module.padding_mode!r}; use padding_mode='zeros'.")
        if module.padding == "same" and any(k % 2 == 0 for k in module.kernel_size):
            raise UnsupportedLayerError(
                f"Conv2d '{name}' uses padding='same' with an even kernel (asymmetric padding); "
                "give the padding explicitly.")

    def forward(self, module, x, weight, bias=None):
        return F.conv2d(x, weight, bias, module.stride, _padding(module), module.dilation, module.groups)

    def grad_input(self, module, x, params, g):
        return torch.nn.grad.conv2d_input(x.shape, params[0].to(g.dtype), g, module.stride, _padding(module),
                                          module.dilation, module.groups)

    def _rows(self, module, x, g):
        a = F.unfold(x, module.kernel_size, module.dilation, _padding(module), module.stride)  # (B, d, T)
        return a.transpose(1, 2), g.flatten(2).transpose(1, 2)  # (B,T,d), (B,T,p)
