"""The ``dp_deepspeed*`` names in Lightning's ``StrategyRegistry`` and the ``DPDeepSpeedStrategy`` arguments each
stands for, defined once for ``registration.py`` (which registers a builder before the strategy is imported) and
``strategy.py`` (which registers the class). Imports nothing."""

from __future__ import annotations

STRATEGY_NAMES = {
    "dp_deepspeed": {},
    "dp_deepspeed_stage_0": {"stage": 0},
    "dp_deepspeed_stage_1": {"stage": 1},
    "dp_deepspeed_stage_2": {"stage": 2},
    "dp_deepspeed_stage_2_offload": {"stage": 2, "offload_optimizer": True},
    "dp_deepspeed_stage_3": {"stage": 3},
    "dp_deepspeed_stage_3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
}


def register_names(registry, strategy) -> None:
    """Register :data:`STRATEGY_NAMES` in Lightning's ``registry`` for ``strategy`` (the class, or a builder marked
    ``builds_dp_strategy``, which the class replaces); a name registered by someone else is left alone."""
    builder = getattr(strategy, "builds_dp_strategy", False)
    for name, kwargs in STRATEGY_NAMES.items():
        current = dict.get(registry, name)  # registry.get(name) would build the strategy
        if current is None or (getattr(current["strategy"], "builds_dp_strategy", False) and not builder):
            registry.register(name, strategy, description=f"DP-SGD on DeepSpeed {kwargs or 'ZeRO stage 2'}",
                              override=True, **kwargs)
