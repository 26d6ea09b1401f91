"""A checkpoint never loses the privacy ledger: save, resume with ckpt_path, compare with an uninterrupted run."""


import pytest

from harness import run_cases
from lightning_dpzero import PrivacyLedger

pytestmark = pytest.mark.slow

BASE = dict(model="token", n=64, batch_size=4, lr=0.5, sigma=None, target_epsilon=4.0, C=0.5,
            clipping="layer-wise", clipping_fn="abadi", poisson=True, accumulate=1, stage=3)


def test_resume_gives_the_same_ledger_and_epsilon(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    cases = [dict(BASE, name="full", steps=6),
             dict(BASE, name="first", steps=6, stop_at=3, save_path=ckpt),
             dict(BASE, name="resumed", steps=6, resume_from=ckpt)]
    res = run_cases(cases, tmp_path / "out", 2)
    # the ledger sits beside the ZeRO shards, and equals the one in the checkpoint's client state
    on_disk = PrivacyLedger.load(tmp_path / "ckpt" / "privacy_ledger.json")
    assert (tmp_path / "ckpt" / "checkpoint").is_dir()
    assert on_disk == PrivacyLedger.from_dict(res["first"]["ledger"])
    assert on_disk.steps == 3
    full, resumed = res["full"], res["resumed"]
    strip = lambda d: [{k: e[k] for k in ("sample_rate", "noise_multiplier", "steps", "sampler")} for e in d["entries"]]
    assert strip(resumed["ledger"]) == strip(full["ledger"])
    assert resumed["ledger"]["run_id"] == res["first"]["ledger"]["run_id"]  # the same ledger, continued
    assert res["first"]["global_step"] == 3 and resumed["global_step"] == 6
    assert resumed["epsilon"] == pytest.approx(full["epsilon"], rel=1e-12)
    assert 0 < full["epsilon"] <= 4.0
    assert resumed["plan"]["noise_multiplier"] == full["plan"]["noise_multiplier"]
