"""Wrap the model in Megatron's DDP and build its optimizer (Adam; fp32 master weights under bf16).

Megatron's own path is used rather than torch DDP/optimizers because ``finalize_model_grads``
also all-reduces the QK-norm gradients, which are partial sums under TP (notes/megatron_cpu.md §3).
The distributed optimizer stays off: it rejects CPU tensors, and the non-distributed one keeps
sleep/wake and checkpoints simple.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from vime.config import TrainerConfig
from vime_trainer.megatron.model import PolicyModel


def wrap_ddp(model: PolicyModel, grad_reduce_in_fp32: bool = True) -> DistributedDataParallel:
    """DDP whose gradients are accumulated and all-reduced (by ``finalize_model_grads``) in fp32,
    or in the parameter dtype when ``grad_reduce_in_fp32`` is False."""
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32,
            overlap_grad_reduce=False,
            use_distributed_optimizer=False,
        ),
        module=model,
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def build_optimizer(ddp: DistributedDataParallel, trainer: TrainerConfig, dtype: torch.dtype) -> Any:
    """Megatron Adam over the DDP model's parameters, with grad-norm clipping at ``trainer.clip_grad``.

    Without TransformerEngine or Apex, Megatron's Adam is ``torch.optim.AdamW`` with its default
    multi-tensor (foreach) step; its parameter groups are switched to torch's fused kernel before
    the first step creates any state (the 4B shape on one H200: the optimizer's 5.7 s of a profiled
    step became 0.07 s).
    """
    config = OptimizerConfig(
        optimizer="adam",
        lr=trainer.lr,
        min_lr=trainer.lr,
        weight_decay=trainer.weight_decay,
        adam_beta1=trainer.adam_beta1,
        adam_beta2=trainer.adam_beta2,
        clip_grad=trainer.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(config, [ddp])
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
    return optimizer
