"""What the DP strategies change in how Lightning starts DeepSpeed: the CPU (gloo) and the ranks given by
DeepSpeed's own launcher (docs/design.md, *Layout*).

Lightning's ``DeepSpeedStrategy`` (the Trainer's and Fabric's alike) refuses a CPU accelerator and passes
``device_rank=None`` to ``deepspeed.initialize`` there; DeepSpeed itself runs on the CPU with gloo. The overrides:
the environment and the process group on the CPU (its op build watched and quiet, ``_extensions``), the global
rank under DeepSpeed's launcher, and a CPU device index for the ``deepspeed.initialize`` calls. Before the launcher
starts anything, fp16 on the CPU is refused and, for the Trainer, a fit is checked in the launching process
(``_prelaunch``). :class:`DeepSpeedLaunchMixin` is the Trainer's, :class:`FabricDeepSpeedLaunchMixin` Fabric's
(whose hooks have other names).
"""

from __future__ import annotations

import contextlib
import os

import torch
from lightning.fabric.accelerators import CUDAAccelerator as FabricCUDAAccelerator
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies.ddp import DDPStrategy
from typing_extensions import override

from ..lightning import prelaunch, refusals, refusal_report
from .extensions import build_watched


def _node_rank_from_launcher() -> None:
    # DeepSpeed's own launcher (``deepspeed --hostfile``) names a process's node CROSS_RANK; Lightning reads
    # only NODE_RANK / GROUP_RANK and would put every node's first process at global rank 0 (a hang).
    if "CROSS_RANK" in os.environ and not {"NODE_RANK", "GROUP_RANK"} & os.environ.keys():
        os.environ["NODE_RANK"] = os.environ["CROSS_RANK"]


def _check_launcher_rank(strategy, settings: str) -> None:
    env = strategy.cluster_environment
    launched = env is not None and env.creates_processes_externally
    if launched and "RANK" in os.environ and int(os.environ["RANK"]) != strategy.global_rank:
        raise ValueError(
            f"The launcher started this process as RANK={os.environ['RANK']}, but Lightning computes global "
            f"rank {strategy.global_rank} from node rank {strategy.node_rank}, local rank {strategy.local_rank} and "
            f"{strategy.num_processes} devices per node. Poisson sampling shards by global rank, so the ranks must "
            f"agree: set {settings}(num_nodes=..., devices=...) to the launcher's nodes and processes per node "
            "(and NODE_RANK where the launcher does not set it).")


@contextlib.contextmanager
def _cpu_device_indices(strategy, on_cuda: bool):
    """Lightning passes ``device_rank=root_device.index`` to ``deepspeed.initialize``; a CPU device has no
    index (None), which DeepSpeed cannot compare. For that call the CPU devices carry their local ranks."""
    if on_cuda or strategy.parallel_devices is None:
        yield
        return
    saved = strategy.parallel_devices
    strategy.parallel_devices = [torch.device("cpu", i) for i in range(len(saved))]
    try:
        yield
    finally:
        strategy.parallel_devices = saved


class DeepSpeedLaunchMixin:
    """Mixed into a Trainer ``DeepSpeedStrategy`` subclass (before it in the bases)."""

    @override
    def _configure_launcher(self) -> None:
        refusals.check_precision(self.precision_plugin.precision, self.accelerator, self.config)
        super()._configure_launcher()
        prelaunch.check_before_launch(self)

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
        with build_watched(report_waits=self.local_rank == 0):
            self._init_deepspeed_distributed()

    @override
    def set_world_ranks(self) -> None:
        _node_rank_from_launcher()
        super().set_world_ranks()
        _check_launcher_rank(self, "Trainer")
        refusal_report.set_rank(self.global_rank)

    def _cpu_device_indices(self):
        return _cpu_device_indices(self, isinstance(self.accelerator, CUDAAccelerator))

    @override
    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        with self._cpu_device_indices():
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)

    @override
    def _initialize_deepspeed_inference(self, model) -> None:  # trainer.validate / test / predict
        with self._cpu_device_indices():
            return super()._initialize_deepspeed_inference(model)


class FabricDeepSpeedLaunchMixin:
    """Mixed into a Fabric ``DeepSpeedStrategy`` subclass (before it in the bases)."""

    @override
    def _configure_launcher(self) -> None:
        refusals.check_precision(self.precision.precision, self.accelerator, self.config)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        if isinstance(self.accelerator, FabricCUDAAccelerator):
            return super().setup_environment()
        from lightning.fabric.strategies.ddp import DDPStrategy as FabricDDPStrategy

        FabricDDPStrategy.setup_environment(self)  # skip the CUDA-only check; calls _setup_distributed

    @override
    def _setup_distributed(self) -> None:
        if isinstance(self.accelerator, FabricCUDAAccelerator):
            return super()._setup_distributed()
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()  # (the CUDA path's device-index check does not apply to CPU devices, which have none)
        self._set_world_ranks()
        with build_watched(report_waits=self.local_rank == 0):
            self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True

    @override
    def _set_world_ranks(self) -> None:
        _node_rank_from_launcher()
        super()._set_world_ranks()
        _check_launcher_rank(self, "Fabric")
        refusal_report.set_rank(self.global_rank)

    @override
    def _initialize_engine(self, model, optimizer=None, scheduler=None):
        with _cpu_device_indices(self, isinstance(self.accelerator, FabricCUDAAccelerator)):
            return super()._initialize_engine(model, optimizer, scheduler)
