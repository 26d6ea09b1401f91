"""A numeric or boolean setting of the wrong type is refused at construction, naming the setting, instead of being
used as something else later (a string delta parsed, ``"yes"`` as True, ``True`` as 1, a negative step bound)."""

import pytest

import lightning_dpzero  # noqa: F401  (registers the strategies)
from lightning_dpzero import DPDeepSpeedStrategy, DPFabricStrategy, PrivacyAccountantCallback

CASES = [
    (lambda: PrivacyAccountantCallback(delta="1e-5"), r"delta='1e-5' is not a number; pass it as one, e\.g\. 1e-05"),
    (lambda: PrivacyAccountantCallback(target_epsilon=True), r"target_epsilon=True is not a number"),
    (lambda: PrivacyAccountantCallback(target_epsilon="8"), r"target_epsilon='8' is not a number"),
    (lambda: PrivacyAccountantCallback(log_second_accountant="no"), r"log_second_accountant='no' is not a bool"),
    (lambda: DPDeepSpeedStrategy(seed=1.5), r"seed=1\.5 is not an integer"),
    (lambda: DPDeepSpeedStrategy(seed="7"), r"seed='7' is not an integer"),
    (lambda: DPDeepSpeedStrategy(secure_mode="yes"), r"secure_mode='yes' is not a bool; pass True or False"),
    (lambda: DPDeepSpeedStrategy(poisson_sampling=1), r"poisson_sampling=1 is not a bool"),
    (lambda: DPFabricStrategy(max_steps=-5), r"max_steps=-5 must be at least 1"),
    (lambda: DPFabricStrategy(max_epochs=2.5), r"max_epochs=2\.5 is not an integer"),
    (lambda: DPFabricStrategy(seed=1.5), r"seed=1\.5 is not an integer"),
    (lambda: DPFabricStrategy(delta="1e-5"), r"delta='1e-5' is not a number"),
]


@pytest.mark.parametrize("build, message", CASES, ids=[m.split("=")[0] + str(i) for i, (_, m) in enumerate(CASES)])
def test_a_setting_of_the_wrong_type_is_refused_when_constructed(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_numbers_of_any_numeric_type_are_accepted():
    import numpy as np

    PrivacyAccountantCallback(target_epsilon=np.float64(8.0), delta=np.float32(1e-5), log_second_accountant=np.True_)
    DPDeepSpeedStrategy(seed=np.int64(3), secure_mode=False)
    DPFabricStrategy(max_steps=10, max_epochs=None, target_epsilon=8)
