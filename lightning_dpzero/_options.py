"""The string options of the public API, as ``Literal`` types, and the one check that refuses a bad value.

A ``Literal`` annotation lets jsonargparse (``LightningCLI``, ``lightning-dpzero fit --config``) refuse a bad
value while parsing a YAML file, before anything is built; :func:`check_option` refuses the same values when the
object is constructed in Python.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

Clipping = Literal["layer-wise", "all-layer", "group-wise"]
ClippingFn = Literal["abadi", "automatic"]
ClippingMode = Literal["book-keeping", "two-pass"]
LossReduction = Literal["mean", "sum"]
LayoutCheck = Literal["every-batch", "first-batch", "off"]
Accountant = Literal["pld", "rdp"]
OnBudgetExhausted = Literal["stop", "raise"]
Sampler = Literal["poisson", "shuffle"]
AccountingWorker = Literal["process", "thread", "none"]


def check_option(name: str, value: Any, options: Any, hint: str = "") -> Any:
    """Return ``value`` if it is one of the ``Literal`` type ``options``; else raise ``ValueError`` naming the
    setting, the value, the allowed values and ``hint``.

    Example:
        >>> check_option("loss_reduction", "sum", LossReduction)
        'sum'
        >>> check_option("loss_reduction", "avg", LossReduction)
        Traceback (most recent call last):
        ...
        ValueError: loss_reduction='avg' is not supported; use one of ('mean', 'sum').
    """
    allowed = get_args(options)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; use one of {allowed}.{' ' + hint if hint else ''}")
    return value
