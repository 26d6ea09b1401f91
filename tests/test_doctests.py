"""Every example in the package's docstrings runs as written (doctest), and every public class shows one."""

import doctest
import importlib
import pkgutil

import pytest

import lightning_dpzero

MODULES = sorted(m.name for m in pkgutil.walk_packages(lightning_dpzero.__path__, "lightning_dpzero."))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.fixture(scope="module", autouse=True)
def _deepspeed_accelerator_chosen():
    """DeepSpeed prints which accelerator it chose the first time it looks; not part of any example's output."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator()


@pytest.mark.parametrize("name", ["lightning_dpzero", *MODULES])
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report = []
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


def _public_classes():
    from lightning_dpzero import (DistributedPoissonBatchSampler, DPDeepSpeedStrategy, PrivacyAccountantCallback,
                                  PrivacyLedger)
    from lightning_dpzero.util.collectives import SingleProcess
    from lightning_dpzero.accounting import LedgerEntry
    from lightning_dpzero.audit import AuditResult
    from lightning_dpzero.checkpoints import CheckpointProtocol, ExportedCheckpoint
    from lightning_dpzero.mechanism import DPMechanism
    from lightning_dpzero.metrics import ClipFraction, MeanGradNorm, PrivacyRunLogger
    from lightning_dpzero.noise import NoiseSource
    from lightning_dpzero.accounting.plan import AccountingSettings, PrivacyPlan
    from lightning_dpzero.sampling import DistributedShuffledBatchSampler

    return [DPDeepSpeedStrategy, PrivacyAccountantCallback, PrivacyLedger, LedgerEntry, PrivacyPlan,
            AccountingSettings, DPMechanism, DistributedPoissonBatchSampler, DistributedShuffledBatchSampler,
            ClipFraction, MeanGradNorm, PrivacyRunLogger, NoiseSource, CheckpointProtocol, ExportedCheckpoint,
            AuditResult, SingleProcess]


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_public_class_has_an_example(cls):
    examples = doctest.DocTestParser().get_examples(cls.__doc__ or "")
    assert examples, f"{cls.__module__}.{cls.__qualname__}'s docstring has no runnable example (>>>)"
