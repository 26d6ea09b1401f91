"""The ``dp_deepspeed*`` strategy names in Lightning's ``StrategyRegistry``, without importing Lightning first.

``import lightning_dpzero`` must register the names (``Trainer(strategy="dp_deepspeed_stage_3")``), but
importing Lightning costs seconds that ``lightning-dpzero ledger ...`` and ``plan`` do not need. So: when
``lightning.pytorch`` is imported already, register now; otherwise a one-shot import hook (a ``sys.meta_path``
finder) does it right after ``lightning.pytorch`` has finished importing, before any ``Trainer`` can be built.
Nothing else is changed about how Lightning is imported.

What is registered first is :func:`_build`, which imports ``lightning_dpzero.strategy`` only when a Trainer asks
for one of the names: the hook can fire in the middle of importing any module of the package that imports
Lightning (``checkpoints/protocol.py``, say), when ``strategy.py``'s own imports of that module would find it
half-initialised. ``strategy.py`` replaces :func:`_build` by the class itself when it is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from ._strategy_names import register_names

_TRIGGER = "lightning.pytorch"


def _build(**kwargs):
    """``DPDeepSpeedStrategy(**kwargs)``, importing it (what a name stands for until ``strategy.py`` is imported)."""
    from .strategy import DPDeepSpeedStrategy

    return DPDeepSpeedStrategy(**kwargs)


_build.builds_dp_strategy = True  # strategy.py's registration replaces it (_strategy_names.register_names)


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    register_names(StrategyRegistry, _build)


def _imported(name: str) -> bool:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands back the real spec of ``lightning.pytorch`` with a loader that registers
    the strategies once the module has executed, then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TRIGGER:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the other finders, as if this one was never there
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        # the module keeps its real loader (resources, reloading); only this one execution is wrapped
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        _register()

    def __getattr__(self, name):
        return getattr(self.loader, name)


def register_strategies_with_lightning() -> None:
    """Register the strategy names now if Lightning is imported, else right after it is (idempotent)."""
    if _imported(_TRIGGER):
        _register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
