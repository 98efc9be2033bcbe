"""Forward-only and forward-backward passes over a list of micro-batches, through Megatron's schedule.

``get_forward_backward_func`` picks the no-pipelining or 1F1B schedule; every pipeline stage walks
the same micro-batch list (the first stage reads the tokens, the last computes the loss from the
hidden states). One optimizer step follows one forward-backward pass (seed step 40). Metrics of
the micro-batches are summed on the last stage and all-reduced over the DP group, so the rank that
reports them (last stage, TP 0, DP 0) holds global-batch values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch.profiler import record_function

from vime_trainer.megatron.micro_batch import MicroBatch
from vime_trainer.megatron.model import PolicyModel

OPTIMIZER_RANGE = "vime/optimizer"
"""Profiler range around the optimizer step (grad norm, clipping, Adam, copy to bf16 weights)."""

# (micro-batch index, micro-batch, hidden states) -> (loss, data) on the last stage.
LossFn = Callable[[int, MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


class Passes:
    """Runs the schedule for one DDP-wrapped model."""

    def __init__(
        self,
        ddp: Any,
        optimizer: Any,
        use_local_attention: bool,
        state_ready: Callable[[], None],
    ) -> None:
        """``state_ready``: called right before each optimizer step (`Offloader.state_ready`: the
        optimizer's state, copied in on a side stream since the wake-up, must be there)."""
        self.ddp = ddp
        self.optimizer = optimizer
        self.use_local_attention = use_local_attention
        self.state_ready = state_ready

    @property
    def model(self) -> PolicyModel:
        return self.ddp.module

    def run(self, mbs: list[MicroBatch], loss_fn: LossFn, forward_only: bool) -> list[dict[str, Any]]:
        """Forward (and backward unless ``forward_only``) over ``mbs``; no optimizer step."""

        def forward_step(data: Iterator[tuple[int, MicroBatch]], model: Any) -> tuple[torch.Tensor, Any]:
            k, mb = next(data)
            mask = mb.causal_mask() if self.use_local_attention else None
            hidden = model(mb.tokens, mb.position_ids, mask, packed_seq_params=mb.packing)
            return hidden, lambda out: loss_fn(k, mb, out)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(list(enumerate(mbs))),
            model=[self.ddp],
            num_microbatches=len(mbs),
            seq_length=max(mb.seq_length for mb in mbs),
            micro_batch_size=max(mb.micro_batch_size for mb in mbs),
            forward_only=forward_only,
        )

    def forward_only(self, mbs: list[MicroBatch], loss_fn: LossFn) -> list[dict[str, Any]]:
        """Outputs of ``loss_fn`` per micro-batch (on the last stage; empty elsewhere), without grads."""
        self.ddp.eval()
        try:
            with torch.no_grad():
                return self.run(mbs, loss_fn, forward_only=True)
        finally:
            self.ddp.train()

    def step(self, mbs: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        """Forward/backward over ``mbs``, then one optimizer step; returns the summed metrics."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self.run(mbs, loss_fn, forward_only=False)
        with record_function(OPTIMIZER_RANGE):
            self.state_ready()
            ok, grad_norm, _ = self.optimizer.step()
        metrics = reduce_metrics(outputs)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["step_ok"] = float(bool(ok))
        return metrics


MAX_SUFFIX = "_max"
"""Metrics named ``*_max`` are maxima over micro-batches and DP ranks; every other one is a sum."""


def reduce_metrics(outputs: list[dict[str, Any]]) -> dict[str, float]:
    """Sum (``*_max``: max) per-micro-batch metrics and all-reduce them over DP (empty off the last
    stage); the mismatch sums become token means."""
    if not ps.is_pipeline_last_stage():
        return {}
    names = sorted(outputs[0]) if outputs else []
    out: dict[str, float] = {}
    for is_max in (False, True):
        keys = [k for k in names if k.endswith(MAX_SUFFIX) == is_max]
        if not keys:
            continue
        stacked = torch.stack([torch.stack([o[k].float() for k in keys]) for o in outputs])
        values = stacked.amax(0) if is_max else stacked.sum(0)
        if ps.get_data_parallel_world_size() > 1:
            op = dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM
            dist.all_reduce(values, op=op, group=ps.get_data_parallel_group())
        out.update(zip(keys, values.tolist(), strict=True))
    return _mismatch_means(out)


def _mismatch_means(out: dict[str, float]) -> dict[str, float]:
    """The mismatch sums as means over the tokens with rollout log-probs (absent without any)."""
    count = out.pop("mismatch_count", 0.0)
    sums = {k: out.pop(k, 0.0) for k in ("mismatch_abs_sum", "mismatch_above_count", "mismatch_ratio_sum")}
    clipped, masked = out.pop("mismatch_clip_count", 0.0), out.pop("mismatch_mask_count", 0.0)
    ratio_max = out.pop("mismatch_ratio_max", 0.0)
    if count:
        out["mismatch_mean_abs"] = sums["mismatch_abs_sum"] / count
        out["mismatch_frac_above"] = sums["mismatch_above_count"] / count
        out["mismatch_tokens"] = count
        out["mismatch_ratio_mean"] = sums["mismatch_ratio_sum"] / count
        out["mismatch_ratio_max"] = ratio_max
        out["mismatch_tis_clipfrac"] = clipped / count
        out["mismatch_mis_maskfrac"] = masked / count
    return out
