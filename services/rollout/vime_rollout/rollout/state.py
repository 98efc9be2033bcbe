"""What one rollout's coroutines share (the seed's GenerateState, step 18), and its sampling settings.

The semaphore bounds requests in flight to ``vllm_server_concurrency × engines``; ``aborted``
turns every queued sample into an aborted one once the batch is full (step 28); the counters
feed the rollout metrics.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vime.config import RunConfig
from vime.types import Sample
from vime.wire.vllm import logprobs_to_request
from vime_rollout.data.dataset import Tokenizer
from vime_rollout.rollout.clock import RolloutClock


class Scorer(Protocol):
    """Scores samples at the reward service: one call per sample, or one per group (group_rm)."""

    async def score(self, samples: list[Sample]) -> list[tuple[float, dict[str, Any] | None]]: ...


class Generator(Protocol):
    """Sends one generate request (through the router) and returns the engine's JSON reply."""

    async def generate(self, payload: dict[str, Any], *, session_id: str | None = None) -> dict[str, Any]: ...


@dataclass(frozen=True)
class SamplingSettings:
    """The seed's sampling parameters before translation (step 19), for training or evaluation."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = False

    @classmethod
    def for_training(cls, cfg: RunConfig) -> SamplingSettings:
        return cls(
            max_new_tokens=cfg.rollout_max_response_len,
            temperature=cfg.rollout_temperature,
            top_p=cfg.rollout_top_p,
            top_k=cfg.rollout_top_k,
            stop=tuple(cfg.rollout_stop),
            stop_token_ids=tuple(cfg.rollout_stop_token_ids),
            skip_special_tokens=cfg.rollout_skip_special_tokens,
        )

    @classmethod
    def for_eval(cls, cfg: RunConfig) -> SamplingSettings:
        greedy = cfg.data.eval_temperature == 0
        return cls(
            max_new_tokens=cfg.rollout_max_response_len,
            temperature=cfg.data.eval_temperature,
            top_p=1.0 if greedy else cfg.rollout_top_p,
            top_k=-1 if greedy else cfg.rollout_top_k,
            stop=tuple(cfg.rollout_stop),
            stop_token_ids=tuple(cfg.rollout_stop_token_ids),
            skip_special_tokens=cfg.rollout_skip_special_tokens,
        )


def logprobs_wanted(cfg: RunConfig, group_index: int) -> int | None:
    """Log-probs per position to request for a group, or None when nothing consumes them.

    They cost about 3× rollout throughput on vLLM (notes/gpu_baselines.md), so they are asked for
    only for rollout-logprob training, mismatch metrics, TIS/MIS, score centering, or a seeded
    ``rollout_logprobs_fraction`` of groups kept for monitoring the train/inference mismatch.
    """
    count = logprobs_to_request(cfg.score_centering_top_k)
    if (
        cfg.use_rollout_logprobs
        or cfg.get_mismatch_metrics
        or cfg.use_tis
        or cfg.use_mis
        or cfg.score_centering_top_k is not None
    ):
        return count
    fraction = cfg.rollout_logprobs_fraction
    if fraction >= 1.0:
        return count
    if fraction > 0.0 and random.Random(f"{cfg.rollout_seed}:logprobs:{group_index}").random() < fraction:
        return count
    return None


@dataclass
class RolloutCounters:
    """What happened during one rollout, for its metrics."""

    requests: int = 0
    generated_tokens: int = 0
    retried_samples: int = 0
    engine_aborts_retried: int = 0
    groups_submitted: int = 0
    groups_dropped: int = 0
    drop_reasons: dict[str, int] = field(default_factory=dict)
    aborted_samples: int = 0
    clock: RolloutClock = field(default_factory=RolloutClock)


@dataclass
class GenerateState:
    """Shared by the coroutines of one rollout (training or evaluation)."""

    cfg: RunConfig
    tokenizer: Tokenizer
    generator: Generator
    scorer: Scorer
    model_name: str
    sampling: SamplingSettings
    concurrency: int
    weight_version: Callable[[], int]
    evaluation: bool = False
    abort_engines: Callable[[], Awaitable[None]] | None = None
    continue_aborted: bool = False
    """A request the engine aborted continues from its partial output instead of starting over."""
    admitted: Callable[[], Awaitable[None]] | None = None
    """Awaited before each round of groups starts (the async producer's admission, seed step 44)."""
    semaphore: asyncio.Semaphore = field(init=False)
    aborted: bool = False
    counters: RolloutCounters = field(default_factory=RolloutCounters)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.semaphore = asyncio.Semaphore(self.concurrency)

    @property
    def send_session_header(self) -> bool:
        """As the seed: the routing key header only when the router hashes on it (step 21)."""
        return self.cfg.router.policy == "consistent_hash"
