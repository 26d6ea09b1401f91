"""tests/reliability: crash and restart, bad input, security, load and auditing (issue #5, docs/reliability.md)."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
for p in (HERE, HERE.parent):  # tests/ for models.py and harness.py; this folder for its helpers
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
