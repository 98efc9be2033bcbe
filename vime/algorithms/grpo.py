"""GRPO rewards: group normalisation (seed step 30) and per-token returns (seed step 39)."""

from __future__ import annotations

import math

STD_EPS = 1e-6


def normalize_group_rewards(
    rewards: list[float], group_size: int, std_normalization: bool = True
) -> list[float]:
    """Centre each group of ``group_size`` consecutive rewards on its mean (seed step 30).

    With ``std_normalization`` and more than one member, divide by the group's unbiased standard
    deviation (n − 1, as ``torch.std``) + 1e-6. Rewards [1,0,0,1,1,0,1,0] become ±0.9354; a group
    of equal rewards becomes all zeros and so contributes no gradient.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not form whole groups of {group_size}")
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start : start + group_size]]
        mean = sum(group) / len(group)
        centered = [r - mean for r in group]
        if std_normalization and len(group) > 1:
            std = math.sqrt(sum(c * c for c in centered) / (len(group) - 1))
            centered = [c / (std + STD_EPS) for c in centered]
        out.extend(centered)
    return out


def get_grpo_returns(rewards: list[float], response_lengths: list[int]) -> list[list[float]]:
    """Broadcast each sample's (normalised) reward over its response tokens (seed step 39).

    For GRPO the advantage of every response token equals the return, which equals the sample's
    normalised reward: a 3-token response with reward +0.9354 gets [0.9354, 0.9354, 0.9354].
    """
    if len(rewards) != len(response_lengths):
        raise ValueError(f"{len(rewards)} rewards but {len(response_lengths)} response lengths")
    return [[float(r)] * int(n) for r, n in zip(rewards, response_lengths, strict=True)]
