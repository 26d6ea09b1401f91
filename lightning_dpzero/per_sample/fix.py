"""``fix_model``: replace the normalisation layers DP training refuses by per-example ones (as Opacus'
``ModuleValidator.fix`` does), keeping their learned affine parameters (docs/supported-models.md).

BatchNorm normalises each example with statistics of the whole batch (one example changes every other example's
gradient, which per-example clipping cannot bound) and keeps running statistics of the private data without
noise; an InstanceNorm with ``track_running_stats=True`` keeps such statistics too. Both are refused before
training (:func:`~lightning_dpzero.per_sample.coverage.check_batch_mixing`); this is the fix the refusal names.
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: the most groups a BatchNorm2d/3d becomes (Opacus' choice: groups of channels that divide C, at most 32)
MAX_GROUPS = 32


def _group_norm(bn: nn.modules.batchnorm._BatchNorm) -> nn.GroupNorm:
    c = bn.num_features
    # BatchNorm1d also takes (N, C) inputs: one channel per group would normalise a single value to 0, so it
    # becomes one group over all channels (and positions), a per-example LayerNorm with per-channel affine
    groups = 1 if isinstance(bn, nn.BatchNorm1d) else math.gcd(MAX_GROUPS, c)
    return nn.GroupNorm(groups, c, eps=bn.eps, affine=bn.affine, **_no_bias(bn))


def _instance_norm(norm: nn.modules.instancenorm._InstanceNorm) -> nn.Module:
    return type(norm)(norm.num_features, eps=norm.eps, momentum=norm.momentum, affine=norm.affine,
                      track_running_stats=False, **_no_bias(norm))


def _no_bias(norm: nn.Module) -> dict:
    # an affine norm without bias (torch >= 2.6's bias=False; older torch has no such argument)
    return {"bias": False} if norm.affine and norm.bias is None else {}


def _replacement(module: nn.Module):
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        raise ValueError(f"fix_model: {type(module).__name__} has not seen an input yet, so its number of "
                         "channels is unknown; run one forward pass of the model first, or construct the layer "
                         "with its number of channels.")
    if isinstance(module, nn.modules.batchnorm._BatchNorm):  # BatchNorm1d/2d/3d and SyncBatchNorm
        return _group_norm(module)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        return _instance_norm(module)
    return None


def _moved(new: nn.Module, old: nn.Module) -> nn.Module:
    """``new`` on ``old``'s device and dtype, with ``old``'s affine weight and bias (and their requires_grad)."""
    weight = getattr(old, "weight", None)
    if weight is not None:
        new = new.to(device=weight.device, dtype=weight.dtype)
        for name in ("weight", "bias"):
            source = getattr(old, name)
            if source is not None:
                with torch.no_grad():
                    getattr(new, name).copy_(source)
                getattr(new, name).requires_grad_(source.requires_grad)
    new.train(old.training)
    return new


def fix_model(module: nn.Module) -> nn.Module:
    """Replace every layer that DP training refuses for mixing examples or keeping private statistics, in place.

    * ``BatchNorm1d``/``2d``/``3d`` and ``SyncBatchNorm`` with C channels become ``GroupNorm(G, C)`` with the same
      ``eps`` and affine weight and bias (the running statistics are dropped): G = gcd(32, C) as in Opacus'
      ``ModuleValidator.fix`` for 2d/3d; G = 1 for ``BatchNorm1d``, whose input may be ``(N, C)`` with one value
      per channel (one channel per group would normalise it to 0).
    * ``InstanceNorm1d/2d/3d(track_running_stats=True)`` become the same layer with
      ``track_running_stats=False`` (its affine parameters kept).

    Every other module is left as it is. The replacement computes another function than the trained BatchNorm (per
    example, not per batch), so fine-tuning a pretrained BatchNorm model starts from a slightly different model.

    Args:
        module: the model (any ``nn.Module``, e.g. a ``LightningModule`` or a torchvision ResNet).

    Returns:
        ``module`` with its layers replaced (the replacement itself if ``module`` is one such layer).

    Raises:
        ValueError: a lazy BatchNorm that has not seen an input (its channel count is unknown).

    Example:
        >>> from torch import nn
        >>> from lightning_dpzero import fix_model
        >>> model = nn.Sequential(nn.Conv2d(3, 48, 3), nn.BatchNorm2d(48), nn.ReLU())
        >>> model = fix_model(model)
        >>> type(model[1]).__name__, model[1].num_groups, model[1].num_channels
        ('GroupNorm', 16, 48)
    """
    return _fixed(module, {})


def _fixed(module: nn.Module, done: dict[int, nn.Module]) -> nn.Module:
    """:func:`fix_model`; ``done``: the replacement of each layer replaced so far, so that a layer shared by two
    parents gets one replacement, shared as well."""
    if id(module) in done:
        return done[id(module)]
    new = _replacement(module)
    if new is not None:
        done[id(module)] = new = _moved(new, module)
        return new
    done[id(module)] = module
    for name, child in list(module.named_children()):
        fixed = _fixed(child, done)
        if fixed is not child:
            setattr(module, name, fixed)
    return module
