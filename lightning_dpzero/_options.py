"""The string options of the public API, as ``Literal`` types, and the one check that refuses a bad value.

A ``Literal`` annotation lets jsonargparse (``LightningCLI``, ``lightning-dpzero fit --config``) refuse a bad
value while parsing a YAML file, before anything is built; :func:`check_option` refuses the same values when the
object is constructed in Python.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

Clipping = Literal["layer-wise", "all-layer", "group-wise"]
ClippingFn = Literal["abadi", "automatic"]
LossReduction = Literal["mean", "sum"]
Accountant = Literal["pld", "rdp"]
OnBudgetExhausted = Literal["stop", "raise"]
Sampler = Literal["poisson", "shuffle"]


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


def check_clipping_options(clipping: Any, clipping_fn: Any, max_grad_norm: float, gamma: float,
                           clipping_groups: Any, group_max_grad_norms: Any) -> None:
    """Refuse a bad combination of the clipping settings of a DP strategy (the Trainer's and Fabric's).

    Raises:
        ValueError: naming the setting and the fix.
    """
    from .per_sample.clipping import validate_clipping, validate_group_thresholds

    validate_clipping(clipping, clipping_fn, max_grad_norm, gamma)
    if clipping == "group-wise" and clipping_groups is None:
        raise ValueError("clipping='group-wise' needs clipping_groups: lists of parameter-name patterns, e.g. "
                         "[['encoder.*'], ['head.*']], or 'param_groups' (the optimizer's parameter groups).")
    if clipping_groups is not None and clipping != "group-wise":
        raise ValueError(f"clipping_groups is only used with clipping='group-wise', not {clipping!r}.")
    if isinstance(clipping_groups, str):
        check_option("clipping_groups", clipping_groups, Literal["param_groups"],
                     "Or give lists of parameter-name patterns, e.g. [['encoder.*'], ['head.*']].")
    if group_max_grad_norms is not None:
        validate_group_thresholds(group_max_grad_norms, max_grad_norm)
