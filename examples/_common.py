"""What the YAML-driven examples share: running ``lightning-dpzero fit`` on a default config, and the
privacy numbers of their one-line summary."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent


def fit_from_config(config: Path, args: Sequence[str]) -> int:
    """``lightning-dpzero fit --config config *args`` with the repository root importable (the configs name
    their classes ``examples.<name>.<Class>``), also in the ranks Lightning launches."""
    root = str(ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    from lightning_dpzero.cli import main as cli_main

    return cli_main(["fit", "--config", str(config), *args])


def privacy_spent(trainer) -> tuple[float, float]:
    """(ε, δ) of the trainer's ``PrivacyAccountantCallback``, or (nan, nan) for a run without one."""
    accountant = next((cb for cb in trainer.callbacks if type(cb).__name__ == "PrivacyAccountantCallback"), None)
    if accountant is None:
        return float("nan"), float("nan")
    return accountant.epsilon(), accountant.delta
