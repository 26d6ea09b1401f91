"""lightning-dpzero: differentially private training for any LightningModule on DeepSpeed ZeRO 0–3.

Importing the package registers the strategies ``dp_deepspeed``, ``dp_deepspeed_stage_{0,1,2,3}`` and
``dp_deepspeed_stage_{2,3}_offload`` with Lightning's Trainer and, the same names, with Lightning Fabric.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from .accounting import PrivacyLedger, calibrate_noise_multiplier
from .callback import PrivacyAccountantCallback, PrivacyBudgetExceeded
from .per_sample import PerSampleEngine, UnsupportedLayerError
from .sampling import DistributedPoissonBatchSampler
from .strategy import DPDeepSpeedStrategy
from .fabric import DPFabricStrategy

DPDeepSpeedStrategy.register_strategies(StrategyRegistry)
DPFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__version__ = "0.1.0"
__all__ = ["DPDeepSpeedStrategy", "DPFabricStrategy", "PrivacyAccountantCallback", "PrivacyBudgetExceeded", "PrivacyLedger", "PerSampleEngine",
           "UnsupportedLayerError", "DistributedPoissonBatchSampler", "calibrate_noise_multiplier"]
