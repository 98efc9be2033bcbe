"""The seed's algorithms under the seed's names.

Pure-Python ones import nothing heavy; the torch ones (`compute_policy_loss`, the masked
aggregations) are loaded on first use so that services without torch can import this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vime.algorithms.grpo import get_grpo_returns, normalize_group_rewards
from vime.algorithms.schedule import DPSchedule, build_dp_schedule, can_reuse_log_probs_in_loss, step_multiple
from vime.algorithms.weight_sync import should_flush_cache

if TYPE_CHECKING:
    from vime.algorithms.policy_loss import (
        compute_policy_loss,
        masked_mean,
        sample_mean_of_token_means,
    )

_TORCH_NAMES = {"compute_policy_loss", "masked_mean", "sample_mean_of_token_means"}

__all__ = [
    "DPSchedule",
    "build_dp_schedule",
    "can_reuse_log_probs_in_loss",
    "compute_policy_loss",
    "get_grpo_returns",
    "masked_mean",
    "normalize_group_rewards",
    "sample_mean_of_token_means",
    "should_flush_cache",
    "step_multiple",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from vime.algorithms import policy_loss

        return getattr(policy_loss, name)
    raise AttributeError(name)
