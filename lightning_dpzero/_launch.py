"""What ``DPDeepSpeedStrategy`` changes in how Lightning starts DeepSpeed: the CPU (gloo) and the ranks given by
DeepSpeed's own launcher (docs/design.md, *Layout*).

Lightning's ``DeepSpeedStrategy`` refuses a CPU accelerator and passes ``device_rank=None`` to
``deepspeed.initialize`` there; DeepSpeed itself runs on the CPU with gloo. Five overrides: the environment and
the process group on the CPU, the global rank under DeepSpeed's launcher, and a CPU device index for the two
``deepspeed.initialize`` calls (training, and validate/test/predict).
"""

from __future__ import annotations

import contextlib
import os

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies.ddp import DDPStrategy
from typing_extensions import override


class DeepSpeedLaunchMixin:
    """Mixed into a ``DeepSpeedStrategy`` subclass (before it in the bases)."""

    @override
    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            return super().setup_environment()
        DDPStrategy.setup_environment(self)  # skip DeepSpeedStrategy's CUDA-only check: CPU + gloo works

    @override
    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            return super().setup_distributed()
        from lightning.fabric.utilities.seed import reset_seed
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def set_world_ranks(self) -> None:
        # DeepSpeed's own launcher (``deepspeed --hostfile``) names a process's node CROSS_RANK; Lightning reads
        # only NODE_RANK / GROUP_RANK and would put every node's first process at global rank 0 (a hang).
        if "CROSS_RANK" in os.environ and not {"NODE_RANK", "GROUP_RANK"} & os.environ.keys():
            os.environ["NODE_RANK"] = os.environ["CROSS_RANK"]
        super().set_world_ranks()
        env = self.cluster_environment
        launched = env is not None and env.creates_processes_externally
        if launched and "RANK" in os.environ and int(os.environ["RANK"]) != self.global_rank:
            raise ValueError(
                f"The launcher started this process as RANK={os.environ['RANK']}, but Lightning computes global "
                f"rank {self.global_rank} from node rank {self.node_rank}, local rank {self.local_rank} and "
                f"{self.num_processes} devices per node. Poisson sampling shards by global rank, so the ranks must "
                "agree: set Trainer(num_nodes=..., devices=...) to the launcher's nodes and processes per node "
                "(and NODE_RANK where the launcher does not set it).")

    @contextlib.contextmanager
    def _cpu_device_indices(self):
        """Lightning passes ``device_rank=root_device.index`` to ``deepspeed.initialize``; a CPU device has no
        index (None), which DeepSpeed cannot compare. For that call the CPU devices carry their local ranks."""
        if isinstance(self.accelerator, CUDAAccelerator) or self.parallel_devices is None:
            yield
            return
        saved = self.parallel_devices
        self.parallel_devices = [torch.device("cpu", i) for i in range(len(saved))]
        try:
            yield
        finally:
            self.parallel_devices = saved

    @override
    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        with self._cpu_device_indices():
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)

    @override
    def _initialize_deepspeed_inference(self, model) -> None:  # trainer.validate / test / predict
        with self._cpu_device_indices():
            return super()._initialize_deepspeed_inference(model)

