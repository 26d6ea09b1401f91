"""lightning-dpzero: differentially private training for any LightningModule on DeepSpeed ZeRO 0–3.

Importing the package registers the strategies ``dp_deepspeed``, ``dp_deepspeed_stage_{0,1,2,3}`` and
``dp_deepspeed_stage_{2,3}_offload`` with Lightning's Trainer and, the same names, with Lightning Fabric: at once if Lightning is already imported, else as soon as
``lightning.pytorch`` (``lightning.fabric``) is, so ``Trainer(strategy="dp_deepspeed_stage_3")`` and
``Fabric(strategy="dp_deepspeed_stage_3")`` find them either way. The public
names are imported when first used (PEP 562), so that reading a ledger (``from lightning_dpzero import
PrivacyLedger``, ``lightning-dpzero ledger ...``) does not import Lightning, DeepSpeed or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .util.lazy import lazy_exports
from .lightning.registration import register_strategies_with_lightning

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "DPDeepSpeedStrategy": "lightning.strategy",
    "DPFabricStrategy": "fabric.strategy",
    "PrivacyAccountantCallback": "lightning.callback",
    "PrivacyBudgetExceeded": "accounting",
    "PrivacyLedger": "accounting",
    "calibrate_noise_multiplier": "accounting",
    "PerSampleEngine": "per_sample",
    "UnsupportedLayerError": "per_sample",
    "DistributedPoissonBatchSampler": "sampling.samplers",
    "fix_model": "per_sample.fix",
    "post_processing": "lightning.post_processing",
}
__all__ = ["DPDeepSpeedStrategy", "DPFabricStrategy", "PrivacyAccountantCallback", "PrivacyBudgetExceeded", "PrivacyLedger", "PerSampleEngine",
           "UnsupportedLayerError", "DistributedPoissonBatchSampler", "calibrate_noise_multiplier", "fix_model",
           "post_processing"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)


if TYPE_CHECKING:  # for type checkers and IDEs: the names as if imported eagerly
    from .lightning.post_processing import post_processing
    from .accounting import PrivacyBudgetExceeded, PrivacyLedger, calibrate_noise_multiplier
    from .lightning.callback import PrivacyAccountantCallback
    from .per_sample import PerSampleEngine, UnsupportedLayerError
    from .per_sample.fix import fix_model
    from .sampling.samplers import DistributedPoissonBatchSampler
    from .fabric.strategy import DPFabricStrategy
    from .lightning.strategy import DPDeepSpeedStrategy

register_strategies_with_lightning()
