"""Privacy accounting: the ledger (source of truth), epsilon via dp-accounting, noise calibration."""

from .accountants import (
    ACCOUNTANTS,
    EpsilonBound,
    EpsilonTracker,
    compute_epsilon,
    epsilon_bound,
    make_accountant,
    value_discretization_interval,
)
from .budget import BudgetGuard, PrivacyBudgetExceeded
from .calibration import calibrate_noise_multiplier, epsilon_for
from .ledger import LedgerEntry, LedgerIntegrityError, PrivacyLedger

__all__ = [
    "ACCOUNTANTS",
    "BudgetGuard",
    "EpsilonBound",
    "EpsilonTracker",
    "LedgerEntry",
    "LedgerIntegrityError",
    "PrivacyBudgetExceeded",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "epsilon_bound",
    "epsilon_for",
    "make_accountant",
    "value_discretization_interval",
]
