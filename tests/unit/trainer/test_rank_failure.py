"""A training rank's failure as the run reports it: out of GPU memory names what to change first."""

from __future__ import annotations

import ray
import torch
from vime_trainer.megatron.actor_group import rank_failure

from vime.config import load_config

BASE = ["rollout_num_gpus=0", "actor_num_gpus_per_node=0", "tensor_model_parallel_size=1"]


def _oom_from_a_rank() -> ray.exceptions.RayTaskError:
    """What ``ray.get`` raises when a rank's task died of CUDA running out of memory."""
    cause = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 298.00 MiB.\nmore lines")
    return ray.exceptions.RayTaskError("read_and_train", "Traceback: ...", cause).as_instanceof_cause()


def test_out_of_memory_names_the_budget_the_recompute_switch_and_the_share() -> None:
    cfg = load_config(
        overrides=[*BASE, "max_tokens_per_gpu=16384", "trainer.gpu_memory_utilization=0.45"], environ={}
    )
    msg = str(rank_failure(_oom_from_a_rank(), cfg))
    assert msg.startswith("a training rank ran out of GPU memory: lower max_tokens_per_gpu=16384")
    assert "trainer.recompute_activations=true" in msg
    assert "trainer.gpu_memory_utilization (now 0.45)" in msg
    assert msg.endswith("CUDA out of memory. Tried to allocate 298.00 MiB.")


def test_without_a_budget_it_names_the_micro_batch_and_no_share() -> None:
    cfg = load_config(overrides=[*BASE, "micro_batch_size=4"], environ={})
    msg = str(rank_failure(_oom_from_a_rank(), cfg))
    assert "lower micro_batch_size=4" in msg and "gpu_memory_utilization" not in msg


def test_other_failures_keep_rays_message() -> None:
    cfg = load_config(overrides=BASE, environ={})
    exc = ray.exceptions.RayTaskError(
        "train", "Traceback: ...", ValueError("bad batch")
    ).as_instanceof_cause()
    assert str(rank_failure(exc, cfg)).startswith("a training rank failed: ")
