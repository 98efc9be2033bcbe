"""Off-policy corrections of the policy-gradient term: truncated (TIS) and masked (MIS) importance
sampling on the ratio between the trainer's and the engine's log-probs of each sampled token.

The ratio is ``exp(train_log_prob − rollout_log_prob)``: the trainer's log-prob before the update
(the PPO "old" policy) over the log-prob the engine sampled the token with. It differs from 1 by
the train/inference numerical mismatch and, in the async mode, by the weights the batch is stale
by. TIS multiplies each token's loss by ``min(ratio, tis_clip)``; MIS zeroes the loss of tokens
(or whole samples) whose ratio leaves ``[mis_low, mis_high]``. Both weights are constants of the
loss (no gradient flows into them). Tokens without rollout log-probs keep weight 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from vime.config import RunConfig

LOG_RATIO_BOUND = 20.0
"""Log-ratios are clamped to ±20 before exp (verl's safety bound): one token whose log-probs
disagree by hundreds of nats must not make the ratio inf."""


@dataclass(frozen=True)
class Correction:
    """The run's TIS / MIS settings (`RunConfig.use_tis` ...)."""

    use_tis: bool = False
    tis_clip: float = 2.0
    use_mis: bool = False
    mis_level: Literal["token", "sample"] = "token"
    mis_low: float = 0.5
    mis_high: float = 2.0

    @classmethod
    def of(cls, cfg: RunConfig) -> Correction:
        return cls(cfg.use_tis, cfg.tis_clip, cfg.use_mis, cfg.mis_level, cfg.mis_low, cfg.mis_high)


@dataclass(frozen=True)
class Weights:
    """Per-token values of one micro-batch's correction."""

    weight: torch.Tensor
    """What multiplies each token's policy-gradient loss (1 where no correction applies)."""
    ratio: torch.Tensor
    """exp(train − rollout) where ``valid``, 1 elsewhere."""
    clipped: torch.Tensor
    """Tokens whose ratio exceeds ``tis_clip`` (what TIS truncates, whether or not it is on)."""
    masked: torch.Tensor
    """Tokens outside the MIS band at ``mis_level`` (what MIS drops, whether or not it is on)."""


def importance_weights(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    valid: torch.Tensor,
    sample_index: torch.Tensor,
    num_samples: int,
    c: Correction,
) -> Weights:
    """The correction of one micro-batch's response tokens (flat ``[R]`` tensors).

    ``valid`` marks the tokens that carry a rollout log-prob and count in the loss;
    ``sample_index`` is each token's sample in ``0..num_samples-1`` (for ``mis_level: sample``,
    where a sample's ratio is the geometric mean of its valid tokens' ratios).
    """
    diff = (train_log_probs.detach() - rollout_log_probs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    log_ratio = torch.where(valid, diff, 0.0)  # NaN rollout log-probs (none sent) never reach exp
    ratio = log_ratio.exp()
    clipped = valid & (ratio > c.tis_clip)
    if c.mis_level == "sample":
        v = valid.to(log_ratio.dtype)
        sums = log_ratio.new_zeros(num_samples).index_add(0, sample_index, log_ratio * v)
        counts = log_ratio.new_zeros(num_samples).index_add(0, sample_index, v)
        sample_ratio = (sums / counts.clamp(min=1.0)).exp()
        out = (counts > 0) & ((sample_ratio < c.mis_low) | (sample_ratio > c.mis_high))
        masked = valid & out[sample_index]
    else:
        masked = valid & ((ratio < c.mis_low) | (ratio > c.mis_high))
    weight = torch.ones_like(ratio)
    if c.use_tis:
        weight = torch.where(valid, ratio.clamp(max=c.tis_clip), weight)
    if c.use_mis:
        weight = torch.where(masked, 0.0, weight)
    return Weights(weight=weight, ratio=ratio, clipped=clipped, masked=masked)
