"""Rollout metrics: lengths, truncation, rewards, filter drops, throughput, and when each part of the
rollout happened (`clock`) (plain floats for JSON)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from vime.types import Sample, SampleStatus
from vime_rollout.rollout.state import RolloutCounters


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{prefix}_mean": float(statistics.fmean(values)),
        f"{prefix}_min": float(min(values)),
        f"{prefix}_max": float(max(values)),
    }


def rollout_metrics(
    groups: list[list[Sample]], counters: RolloutCounters, wall_s: float, prefix: str = "rollout"
) -> dict[str, float]:
    """Metrics of the kept groups plus what the loop counted (drops, retries, aborts)."""
    samples = [s for g in groups for s in g]
    rewards = [float(s.reward) for s in samples if s.reward is not None]
    response_lengths = [float(s.response_length) for s in samples]
    out: dict[str, float] = {
        "num_groups": float(len(groups)),
        "num_samples": float(len(samples)),
        "response_tokens": float(sum(response_lengths)),
        "generated_tokens": float(counters.generated_tokens),
        "wall_s": float(wall_s),
        "tokens_per_s": float(counters.generated_tokens / wall_s) if wall_s > 0 else 0.0,
        "truncated_ratio": (
            sum(s.status is SampleStatus.TRUNCATED for s in samples) / len(samples) if samples else 0.0
        ),
        "groups_submitted": float(counters.groups_submitted),
        "groups_dropped": float(counters.groups_dropped),
        "aborted_samples": float(counters.aborted_samples),
        "requests": float(counters.requests),
        "engine_aborts_retried": float(counters.engine_aborts_retried),
        "samples_with_logprobs": float(sum(s.rollout_log_probs is not None for s in samples)),
        **_stats("response_len", response_lengths),
        **_stats("prompt_len", [float(s.prompt_length) for s in samples]),
        **counters.clock.metrics(),
    }
    if rewards:
        out["reward_mean"] = float(statistics.fmean(rewards))
        out["reward_std"] = float(statistics.pstdev(rewards)) if len(rewards) > 1 else 0.0
    for reason, count in sorted(counters.drop_reasons.items()):
        out[f"dropped/{reason}"] = float(count)
    return {f"{prefix}/{k}": v for k, v in out.items()}


def engine_request_metrics(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How the rollout's requests spread over the engines (seed: 256 over 4 engines, ~64 each),
    from each engine's finished-request counter read before and after; engines restarted in
    between (counter went down) or silent on either side are left out."""
    deltas = [after[u] - before[u] for u in after if u in before and after[u] >= before[u]]
    if not deltas:
        return {}
    return {
        "rollout/engines_reporting": float(len(deltas)),
        "rollout/engine_requests_min": min(deltas),
        "rollout/engine_requests_max": max(deltas),
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for ``c`` correct out of ``n`` samples: 1 − C(n−c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(name: str, groups: list[list[Sample]], wall_s: float) -> dict[str, float]:
    """Mean reward, truncation and pass@k (k = 1, 2, 4, ... ≤ samples per prompt) of one eval set."""
    samples = [s for g in groups for s in g]
    rewards = [float(s.reward or 0.0) for s in samples]
    out: dict[str, float] = {
        "num_prompts": float(len(groups)),
        "num_samples": float(len(samples)),
        "reward_mean": float(statistics.fmean(rewards)) if rewards else 0.0,
        "response_len_mean": float(statistics.fmean(s.response_length for s in samples)) if samples else 0.0,
        "truncated_ratio": (
            sum(s.status is SampleStatus.TRUNCATED for s in samples) / len(samples) if samples else 0.0
        ),
        "wall_s": float(wall_s),
    }
    n = min((len(g) for g in groups), default=0)
    k = 1
    while n and k <= n:
        scores = [pass_at_k(len(g), sum((s.reward or 0.0) > 0 for s in g), k) for g in groups]
        out[f"pass@{k}"] = float(statistics.fmean(scores))
        k *= 2
    return {f"eval/{name}/{key}": v for key, v in out.items()}
