"""The string options of the public API, as ``Literal`` types, and the checks that refuse a bad option value
(:func:`check_option`; numbers and flags: :func:`check_number`, :func:`check_flag`).

A ``Literal`` annotation lets jsonargparse (``LightningCLI``, ``lightning-dpzero fit --config``) refuse a bad
value while parsing a YAML file, before anything is built; :func:`check_option` refuses the same values when the
object is constructed in Python.
"""

from __future__ import annotations

import numbers
from typing import Any, Literal, Optional, get_args

Clipping = Literal["layer-wise", "all-layer", "group-wise"]
ClippingFn = Literal["abadi", "automatic"]
ClippingMode = Literal["book-keeping", "two-pass"]
PrivacyUnit = Literal["example", "user"]
NoiseMechanism = Literal["dp-sgd", "banded-mf", "blt"]
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


def check_number(name: str, value: Any, *, integer: bool = False, minimum: Optional[float] = None,
                 optional: bool = False, hint: str = "") -> Any:
    """Return ``value`` if it is a number (an integer with ``integer``; ``bool`` and strings are not numbers) of at
    least ``minimum`` (None also, with ``optional``); else raise ``ValueError`` naming the setting and the value.
    Numeric settings are checked at construction: a string or a bool would otherwise be used as one much later
    (``"1e-5"`` parsed, ``True`` as 1), or fail in the middle of training.

    Example:
        >>> check_number("seed", 7, integer=True, optional=True)
        7
        >>> check_number("seed", 1.5, integer=True, optional=True)
        Traceback (most recent call last):
        ...
        ValueError: seed=1.5 is not an integer.
        >>> check_number("delta", "1e-5")
        Traceback (most recent call last):
        ...
        ValueError: delta='1e-5' is not a number; pass it as one, e.g. 1e-05 (not a string).
    """
    if value is None and optional:
        return value
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        if integer and isinstance(value, numbers.Real) and not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} is not an integer.{' ' + hint if hint else ''}")
        example = "" if isinstance(value, bool) or not isinstance(value, str) else _as_number(value)
        raise ValueError(f"{name}={value!r} is not {'an integer' if integer else 'a number'}"
                         f"{'; pass it as one, e.g. ' + example + ' (not a string)' if example else ''}."
                         f"{' ' + hint if hint else ''}")
    if minimum is not None and not value >= minimum:
        raise ValueError(f"{name}={value!r} must be at least {minimum}.{' ' + hint if hint else ''}")
    return value


def _as_number(text: str) -> str:
    try:
        return repr(float(text))
    except ValueError:
        return ""


def check_flag(name: str, value: Any) -> bool:
    """Return ``value`` if it is a ``bool`` (or numpy's), else raise ``ValueError`` naming the setting: a string such
    as ``"no"`` is truthy and would silently switch the option on.

    Example:
        >>> check_flag("secure_mode", "yes")
        Traceback (most recent call last):
        ...
        ValueError: secure_mode='yes' is not a bool; pass True or False.
    """
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise ValueError(f"{name}={value!r} is not a bool; pass True or False.")


def check_loop_bounds(max_steps: Any, max_epochs: Any) -> tuple:
    """``(max_steps, max_epochs)`` of a loop the strategy plans σ for, each None or an integer >= 1 (a negative
    bound would plan a run of no steps, or of every step there is); else ``ValueError`` naming the setting."""
    hint = "Give the number of optimizer steps (epochs) the loop runs, or None."
    return (check_number("max_steps", max_steps, integer=True, minimum=1, optional=True, hint=hint),
            check_number("max_epochs", max_epochs, integer=True, minimum=1, optional=True, hint=hint))
