"""The Fabric face: ``DPFabricStrategy`` (``strategy.py``) and where a Fabric training loop meets the DP step
(``loop.py``) (docs/fabric.md; docs/design.md, *Where each piece runs*: Fabric)."""

from .strategy import DPFabricStrategy

__all__ = ["DPFabricStrategy"]
