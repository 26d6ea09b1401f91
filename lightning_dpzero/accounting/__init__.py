"""Privacy accounting: the ledger (source of truth), epsilon via dp-accounting, noise calibration."""

from .accountants import (
    ACCOUNTANTS,
    PLD_VALUE_DISCRETIZATION_INTERVAL,
    EpsilonTracker,
    compute_epsilon,
    make_accountant,
)
from .budget import BudgetGuard, PrivacyBudgetExceeded
from .calibration import calibrate_noise_multiplier, epsilon_for
from .ledger import LedgerEntry, LedgerIntegrityError, PrivacyLedger

__all__ = [
    "ACCOUNTANTS",
    "BudgetGuard",
    "PLD_VALUE_DISCRETIZATION_INTERVAL",
    "EpsilonTracker",
    "LedgerEntry",
    "LedgerIntegrityError",
    "PrivacyBudgetExceeded",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "epsilon_for",
    "make_accountant",
]
