"""The ``dp_deepspeed*`` strategy names in Lightning's registries (the Trainer's ``StrategyRegistry`` and Fabric's
``STRATEGY_REGISTRY``), without importing Lightning first.

``import lightning_dpzero`` must register the names (``Trainer(strategy="dp_deepspeed_stage_3")``), but
importing Lightning costs seconds that ``lightning-dpzero ledger ...`` and ``plan`` do not need. So: when
``lightning.pytorch`` is imported already, register now; otherwise a one-shot import hook (a ``sys.meta_path``
finder) does it right after ``lightning.pytorch`` has finished importing, before any ``Trainer`` can be built;
the same for ``lightning.fabric`` and ``Fabric``.
Nothing else is changed about how Lightning is imported.

What is registered first is :func:`_build`, which imports ``lightning_dpzero.lightning.strategy`` only when a
Trainer asks for one of the names: the hook can fire in the middle of importing any module of the package that
imports Lightning (``checkpoints/protocol.py``, say), when ``strategy.py``'s own imports of that module would find
it half-initialised. ``strategy.py`` (``fabric/strategy.py``) replaces the builder by the class itself when it is
imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from .strategy_names import register_names

def _build(**kwargs):
    """``DPDeepSpeedStrategy(**kwargs)``, importing it (what a name stands for until ``strategy.py`` is imported)."""
    from .strategy import DPDeepSpeedStrategy

    return DPDeepSpeedStrategy(**kwargs)


def _build_fabric(**kwargs):
    """``DPFabricStrategy(**kwargs)``, importing it (until ``fabric/strategy.py`` is imported)."""
    from ..fabric.strategy import DPFabricStrategy

    return DPFabricStrategy(**kwargs)


_build.builds_dp_strategy = _build_fabric.builds_dp_strategy = True  # replaced by the classes (register_names)


def _register_trainer() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    register_names(StrategyRegistry, _build)


def _register_fabric() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    register_names(STRATEGY_REGISTRY, _build_fabric)


#: the module whose import triggers each registration (``lightning.pytorch`` imports ``lightning.fabric``)
_TRIGGERS = {"lightning.fabric": _register_fabric, "lightning.pytorch": _register_trainer}


def _imported(name: str) -> bool:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands back the real spec of a trigger module with a loader that registers the
    strategies once the module has executed; leaves ``sys.meta_path`` when every trigger has fired."""

    def __init__(self, pending: dict):
        self.pending = dict(pending)

    def find_spec(self, fullname, path=None, target=None):
        register = self.pending.pop(fullname, None)
        if register is None:
            return None
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the other finders (this one no longer answers for it)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisteringLoader(spec.loader, register)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader, register):
        self.loader, self.register = loader, register

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        # the module keeps its real loader (resources, reloading); only this one execution is wrapped
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        self.register()

    def __getattr__(self, name):
        if name in ("loader", "register"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def register_strategies_with_lightning() -> None:
    """Register the strategy names in each registry now if its Lightning package is imported, else right after
    it is (idempotent)."""
    pending = {}
    for trigger, register in _TRIGGERS.items():
        if _imported(trigger):
            register()
        else:
            pending[trigger] = register
    if pending and not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport(pending))
