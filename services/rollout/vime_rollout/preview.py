"""A preview's samples (``publish=false``, `vime rollout`): the groups of a rollout, ordered and with
the advantages they would have trained with, as wire samples instead of a batch in Redis."""

from __future__ import annotations

from vime.config import RunConfig
from vime.types import Sample
from vime.wire.rollout import RolloutSample
from vime_rollout.batch_builder import advantages_for, order_groups


def preview_samples(cfg: RunConfig, groups: list[list[Sample]]) -> list[RolloutSample]:
    """Groups in ``group_index`` order, each sample with its GRPO advantage (seed step 30)."""
    n = cfg.n_samples_per_prompt
    samples = order_groups(groups, n)
    return [
        RolloutSample(
            group_index=s.group_index,
            index=s.index,
            prompt=s.prompt,
            response=s.response,
            prompt_ids=s.tokens[: len(s.tokens) - s.response_length],
            response_ids=s.tokens[len(s.tokens) - s.response_length :],
            reward=s.reward,
            advantage=a,
            status=s.status.value,
            weight_version=s.weight_version,
        )
        for s, a in zip(samples, advantages_for(cfg, samples, n), strict=True)
    ]
