"""PPO-clip policy loss (seed step 40) and the masked aggregations over response tokens."""

from __future__ import annotations

import torch


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped policy loss and clip indicator (seed step 40).

    ``ppo_kl = old_log_probs − log_probs``, so ``ratio = exp(−ppo_kl)`` and
    ``loss = max(−ratio·A, −clip(ratio, 1−eps_clip, 1+eps_clip_high)·A)``. At ratio 1 the loss is
    −A (−0.9354 for A=+0.9354) and its gradient is non-zero; once the ratio is clipped the clipped
    branch is constant and the gradient is zero. With ``eps_clip_c`` (dual clip) the loss of
    negative-advantage tokens is capped at −eps_clip_c·A.
    Returns ``(per_token_loss, clipfrac)`` where clipfrac is 1.0 where the clip was active.
    """
    ratio = (-ppo_kl).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).float()
    if eps_clip_c is None:
        return clip_pg_losses1, clipfrac
    if eps_clip_c <= 1.0:
        raise ValueError(f"eps_clip_c must be > 1 for the dual clip, got {eps_clip_c}")
    pg_losses3 = -eps_clip_c * advantages
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1), clipfrac


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def sample_mean_of_token_means(
    values: torch.Tensor,
    mask: torch.Tensor,
    response_lengths: list[int],
    num_samples: int | None = None,
    sample_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Average over samples of each sample's masked token mean.

    ``values`` and ``mask`` are the response tokens of several samples concatenated; each sample
    weighs the same whatever its length (prompt tokens never appear here, masked tokens do not
    count). ``num_samples`` is the divisor (the global batch when micro-batches are accumulated).
    ``sample_index`` (each token's sample, on the values' device) saves building it from
    ``response_lengths``, a host-to-device copy that waits for the device.
    """
    if sum(response_lengths) != values.numel():
        raise ValueError(
            f"response_lengths sum to {sum(response_lengths)} but values has {values.numel()} entries"
        )
    n = len(response_lengths)
    mask = mask.to(values.dtype)
    if sample_index is None:
        sample_index = torch.repeat_interleave(
            torch.arange(n, device=values.device),
            torch.as_tensor(response_lengths, device=values.device),
            output_size=values.numel(),
        )
    # Segment sums (one kernel each, whatever n) rather than a per-sample loop of masked_mean.
    sums = values.new_zeros(n).index_add(0, sample_index, values * mask)
    counts = values.new_zeros(n).index_add(0, sample_index, mask)
    total = (sums / counts.clamp(min=1.0)).sum()
    return total / (num_samples if num_samples is not None else max(1, n))
