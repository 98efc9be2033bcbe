"""Batches for the supervised warm-up (``TrainerConfig.sft_warmup_steps``), in the RL batch format.

A warm-up example is (prompt tokens, label tokens); it becomes a sample whose "response" is the
label, fully in the loss mask, so the trainer's micro-batching, DP split and loss aggregation are
exactly those of the RL step (`TrainRank.train_sft` takes the cross-entropy of the label tokens).
One call builds one optimizer step: ``global_batch_size`` examples split over the DP ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

from vime.algorithms import build_dp_schedule
from vime.batch import RankBatch, RolloutBatch, split_by_dp
from vime.config import RunConfig
from vime.types import Sample, SampleStatus


def sft_rank_batches(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]], config: RunConfig, step: int = 0
) -> list[RankBatch]:
    """One warm-up step's `RankBatch` per DP rank from ``global_batch_size`` (prompt, label) pairs."""
    gbs = config.global_batch_size or 0
    if len(examples) != gbs:
        raise ValueError(f"a warm-up step takes global_batch_size={gbs} examples, got {len(examples)}")
    samples = []
    for i, (prompt, label) in enumerate(examples):
        if not prompt or not label:
            raise ValueError(f"warm-up example {i} needs a non-empty prompt and label")
        samples.append(
            Sample(
                tokens=[*prompt, *label],
                response_length=len(label),
                loss_mask=[1] * len(label),
                status=SampleStatus.COMPLETED,
                index=i,
                group_index=i,
            )
        )
    batch = RolloutBatch.from_samples(
        samples,
        batch_id=f"sft:{step}",
        run_id=config.run_id or "sft",
        rollout_id=step,
        weight_version=0,
        advantages=[0.0] * len(samples),
    )
    schedule = build_dp_schedule(
        batch.total_lengths().tolist(),
        gbs,
        config.micro_batch_size,
        config.dp_size,
        config.max_tokens_per_gpu,
    )
    return split_by_dp(batch, schedule)
