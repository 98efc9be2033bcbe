"""The batch builder (seed steps 30–31): groups → columnar batch → GRPO advantages → DP shares → Redis.

Groups are laid out in ``group_index`` order (a batch does not depend on which group finished
first), each group's samples consecutive, so `normalize_group_rewards` can centre (and scale by
the unbiased std + 1e-6) every ``n_samples_per_prompt`` consecutive rewards: [1,0,0,1,1,0,1,0]
→ ±0.9354. The DP schedule (``num_microbatches=[8]`` for the seed's 256 samples, micro-batch 8,
DP 4) splits the batch into one share per trainer rank, published with `vime.queue`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from redis.asyncio import Redis

from vime.algorithms import build_dp_schedule, normalize_group_rewards, step_multiple
from vime.batch import RankBatch, RolloutBatch, split_by_dp
from vime.config import RunConfig
from vime.queue import BatchPublisher, PublishResult, connect
from vime.types import Sample


class BatchBuildError(ValueError):
    """Groups that cannot form a training batch (wrong sizes, missing rewards, bad DP size)."""


@dataclass(frozen=True)
class BuiltBatch:
    """A batch and its per-rank shares, ready to publish."""

    batch: RolloutBatch
    shares: list[RankBatch]


def order_groups(groups: list[list[Sample]], group_size: int) -> list[Sample]:
    """Samples of all groups, groups by ``group_index`` and samples by ``index`` within a group."""
    for g in groups:
        if len(g) != group_size:
            raise BatchBuildError(
                f"group {g[0].group_index if g else '?'} has {len(g)} samples, not {group_size}"
            )
        if len({s.group_index for s in g}) != 1:
            raise BatchBuildError("a group mixes samples of different prompts (group_index differs)")
    ordered = sorted(groups, key=lambda g: (g[0].group_index is None, g[0].group_index or 0))
    return [s for g in ordered for s in sorted(g, key=lambda s: s.index or 0)]


def advantages_for(cfg: RunConfig, samples: list[Sample], group_size: int) -> list[float]:
    """GRPO group normalisation of the raw rewards (seed step 30)."""
    missing = [s.index for s in samples if s.reward is None]
    if missing:
        raise BatchBuildError(f"samples without a reward cannot be trained on: indices {missing[:10]}")
    rewards = [float(s.reward or 0.0) for s in samples]
    return normalize_group_rewards(rewards, group_size, std_normalization=cfg.grpo_std_normalization)


def build_batch(
    cfg: RunConfig,
    groups: list[list[Sample]],
    *,
    batch_id: str,
    run_id: str,
    rollout_id: int,
    weight_version: int,
    dp_size: int,
    metrics: dict[str, float] | None = None,
) -> BuiltBatch:
    """The columnar batch with advantages and its DP shares (seed steps 30–31)."""
    n = cfg.n_samples_per_prompt
    samples = order_groups(groups, n)
    advantages = advantages_for(cfg, samples, n)
    gbs = cfg.global_batch_size or len(samples)
    multiple, what = step_multiple(cfg.micro_batch_size, dp_size, cfg.max_tokens_per_gpu)
    if len(samples) % gbs or gbs % multiple:
        raise BatchBuildError(
            f"{len(samples)} samples do not split into steps of global_batch_size={gbs} over "
            f"dp_size={dp_size} (a step must be a multiple of {what})"
        )
    all_metrics = {**(metrics or {}), **_advantage_metrics(advantages, n)}
    batch = RolloutBatch.from_samples(
        samples,
        batch_id=batch_id,
        run_id=run_id,
        rollout_id=rollout_id,
        weight_version=weight_version,
        advantages=advantages,
        metrics=all_metrics,
    )
    schedule = build_dp_schedule(
        [int(x) for x in batch.total_lengths()], gbs, cfg.micro_batch_size, dp_size, cfg.max_tokens_per_gpu
    )
    batch.metrics["rollout/num_steps"] = float(len(schedule.num_microbatches))
    return BuiltBatch(batch, split_by_dp(batch, schedule))


def _advantage_metrics(advantages: list[float], group_size: int) -> dict[str, float]:
    zero_groups = sum(
        all(a == 0.0 for a in advantages[i : i + group_size]) for i in range(0, len(advantages), group_size)
    )
    return {
        "rollout/advantage_abs_mean": float(statistics.fmean(abs(a) for a in advantages))
        if advantages
        else 0.0,
        "rollout/zero_advantage_groups": float(zero_groups),
    }


class BatchSink:
    """Publishes built batches for the trainer, numbering attempts so a batch id is never reused."""

    def __init__(self, redis_url: str, run_id: str) -> None:
        self.run_id = run_id
        self.publisher = BatchPublisher(redis_url, run_id)
        self._redis = connect(redis_url)

    @property
    def redis(self) -> Redis:
        return self._redis

    async def next_batch_id(self, rollout_id: int) -> str:
        """``run:rollout:attempt``: the attempt counter lives in Redis, so it survives restarts."""
        key = f"vime:{self.run_id}:rollout_attempts:{rollout_id}"
        attempt = int(await self._redis.incr(key)) - 1
        return f"{self.run_id}:{rollout_id}:{attempt}"

    async def publish(self, built: BuiltBatch) -> PublishResult:
        return await self.publisher.publish(built.batch, built.shares)

    async def pending_count(self) -> int:
        return await self.publisher.pending_count()

    async def aclose(self) -> None:
        await self.publisher.aclose()
        await self._redis.aclose()
