"""The one way ``lightning-dpzero`` builds Lightning's ``LightningCLI`` (for ``fit ...`` and for ``plan --config``),
so that a plan reads a config exactly as the run does."""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence


def build_cli(argv: Optional[Sequence[str]], *, description: str = "", run: bool = True):
    """``LightningCLI`` with ``subclass_mode`` for the model and the datamodule (both named by ``class_path``) and
    the DP strategies registered. ``argv=None`` reads ``sys.argv``; ``run=False`` only instantiates the trainer,
    the model and the datamodule (no subcommand, no config saved)."""
    from lightning.pytorch.cli import LightningCLI

    import lightning_dpzero.lightning.strategy  # noqa: F401  (registers the dp_deepspeed* strategies)

    # Like `python -m`, let a config's class_path name modules of the directory it is run from.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    kwargs = {"save_config_kwargs": {"overwrite": True}} if run else {"save_config_callback": None}
    argv0 = sys.argv
    if not run:  # a command of its own (`plan --config`) hands the arguments over: no "args and sys.argv" warning
        sys.argv = sys.argv[:1]
    try:
        return LightningCLI(subclass_mode_model=True, subclass_mode_data=True,
                            parser_kwargs={"description": description},
                            args=None if argv is None else list(argv), run=run, **kwargs)
    finally:
        sys.argv = argv0
