"""tests/reliability: crash and restart, bad input, security, load and auditing (issue #5, docs/reliability.md)."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
for p in (HERE, HERE.parent):  # tests/ for models.py and harness.py; this folder for its helpers
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


import pytest


@pytest.fixture
def noise_draws(monkeypatch):
    """Every Gaussian draw of the DP noise, flattened, in order (``NoiseSource.normal`` recorded)."""
    from lightning_dpzero import noise as noise_module

    draws = []
    original = noise_module.NoiseSource.normal

    def recording(self, shape, device):
        z = original(self, shape, device)
        draws.append(z.detach().flatten().clone())
        return z

    monkeypatch.setattr(noise_module.NoiseSource, "normal", recording)
    return draws
