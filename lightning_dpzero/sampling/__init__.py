"""Which examples a step trains on (docs/design.md, *Where each piece runs*: the training loader): the distributed
Poisson and shuffled samplers and their rates (``samplers.py``), the private DataLoader (``loader.py``), the ranks'
one N and q over one dataset or per-rank shards (``shards.py``), user-level sampling (``users.py``), cyclic Poisson
sampling over fixed parts (``cyclic.py``, for BandMF), examples reached twice (``repeats.py``), and an empty
micro-batch: its collate and stand-in (``collate.py``), its loss (``micro_batch.py``).

The public names below are importable from here, as they were from the one ``sampling`` module.
"""

from .collate import empty_safe_collate
from .loader import check_sampler_describable, dataset_size, private_dataloader
from .samplers import (DistributedPoissonBatchSampler, DistributedShuffledBatchSampler, poisson_sample_rate,
                       shuffled_sample_rate)

__all__ = ["DistributedPoissonBatchSampler", "DistributedShuffledBatchSampler", "empty_safe_collate",
           "private_dataloader", "poisson_sample_rate", "shuffled_sample_rate", "dataset_size",
           "check_sampler_describable"]
