"""Per-rank process set-up: device, torch.distributed (NCCL on GPU, gloo on CPU), Megatron groups, RNG.

This is the only place that decides between GPU and CPU: with a GPU the rank uses NCCL and seeds
Megatron's CUDA RNG tracker; without one it installs the CPU shim first, uses gloo, keeps torch to
the threads it was given (1 per rank on a 2-core machine) and uses Megatron's no-op RNG tracker
(dropout is off in training configs, so nothing needs a forked CUDA RNG).
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from vime_trainer.megatron.cpu_shim import install_cpu_shim


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the TP × PP × DP grid."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: str

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def reports_metrics(self) -> bool:
        """The one rank whose step metrics the group returns (already reduced over DP)."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0


def use_gpu() -> bool:
    return torch.cuda.is_available()


def init_rank(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    tp: int,
    pp: int,
    seed: int,
    cpu_threads: int = 1,
    timeout_s: float = 1800.0,
) -> RankInfo:
    """Initialise this rank's process group and Megatron's model-parallel state."""
    if use_gpu():
        local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        backend, device = "nccl", f"cuda:{local}"
    else:
        install_cpu_shim()
        torch.set_num_threads(max(1, cpu_threads))
        backend, device = "gloo", "cpu"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if use_gpu():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return RankInfo(
        rank=rank,
        world_size=world_size,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=tp,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=pp,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        device=device,
    )


def shutdown_rank() -> None:
    """Tear down Megatron's groups and the process group (best effort)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
