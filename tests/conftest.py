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
