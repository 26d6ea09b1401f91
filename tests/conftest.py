"""Test configuration.

* Property tests are derandomised in CI so a run is reproducible.
* DeepSpeed JIT-builds its CPU shared-memory communication op on first use; a build directory per virtual
  environment stops two environments on one machine from rebuilding each other's copy.
"""

import os
import sys

from hypothesis import settings

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_environment():
    """An in-process Trainer leaves MASTER_ADDR/MASTER_PORT set (its TCP store still listens on that port);
    a later test's subprocess must not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
