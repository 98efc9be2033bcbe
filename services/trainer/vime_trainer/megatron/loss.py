"""The per-micro-batch losses of seed step 40 (PPO-clip policy loss) and of the supervised warm-up.

Each loss is a ``sample_mean_of_token_means`` over the micro-batch's response tokens (``loss_mask``
selects them) divided by the *global* batch size, so that summing over micro-batches and DP ranks
gives the mean over the global batch. Megatron's schedule divides every micro-batch loss by the
number of micro-batches and DDP averages gradients over DP ranks; the returned loss is multiplied
by both to cancel that. Metrics are detached sums that add up (over micro-batches and DP ranks)
to global-batch means; ``*_sum`` / ``*_count`` pairs become token means at the end of the step.

Policy log-probs (current, old, reference) and the entropy are those of logits / the rollout
temperature, the distribution the engines sampled from. The supervised warm-up's cross-entropy is
at temperature 1: it fits the model itself to the labels, not its sampling distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vime.algorithms import compute_policy_loss, sample_mean_of_token_means
from vime.algorithms.off_policy import Correction, Weights, importance_weights
from vime_trainer.megatron.logprobs import response_log_probs
from vime_trainer.megatron.micro_batch import MicroBatch

MISMATCH_THRESHOLD = 0.1

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LossSettings:
    """What the loss needs from the run config and the step's schedule."""

    eps_clip: float
    eps_clip_high: float
    eps_clip_c: float | None
    kl_coef: float
    kl_loss_type: str
    entropy_coef: float
    global_batch_size: int
    num_microbatches: int
    dp_size: int
    chunk_size: int
    temperature: float
    """The rollout temperature (> 0): log-probs are of logits / temperature."""
    correction: Correction = field(default_factory=Correction)
    """TIS / MIS on the policy-gradient term (`vime.algorithms.off_policy`)."""

    @property
    def schedule_scale(self) -> float:
        """Undo the schedule's division by micro-batches and DDP's average over DP ranks."""
        return float(self.num_microbatches * self.dp_size)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate against the reference policy (k1, or the low-variance k3)."""
    if kind == "k1":
        return log_probs - ref_log_probs
    log_ratio = ref_log_probs - log_probs
    return (log_ratio.exp() - 1 - log_ratio).clamp(-10.0, 10.0)


def _aggregate(mb: MicroBatch, settings: LossSettings) -> Callable[[torch.Tensor], torch.Tensor]:
    def agg(values: torch.Tensor) -> torch.Tensor:
        return sample_mean_of_token_means(
            values,
            mb.loss_mask,
            mb.response_lengths,
            num_samples=settings.global_batch_size,
            sample_index=mb.sample_index,
        )

    return agg


def correction_weights(train_log_probs: torch.Tensor, mb: MicroBatch, c: Correction) -> Weights:
    """TIS / MIS weights of the micro-batch's tokens (tokens with rollout log-probs only)."""
    valid = mb.has_rollout_log_probs & (mb.loss_mask > 0)
    sample_index = mb.sample_index
    if sample_index is None:
        lengths = torch.as_tensor(mb.response_lengths, device=valid.device)
        sample_index = torch.repeat_interleave(torch.arange(mb.num_samples, device=valid.device), lengths)
    return importance_weights(train_log_probs, mb.rollout_log_probs, valid, sample_index, mb.num_samples, c)


def mismatch_counts(train_log_probs: torch.Tensor, mb: MicroBatch, w: Weights) -> Metrics:
    """Sums (and a max) behind the train/inference mismatch metrics (tokens with rollout log-probs
    only): |Δ log p|, the importance ratio, the tokens TIS would truncate and MIS would drop."""
    sel = mb.has_rollout_log_probs & (mb.loss_mask > 0)
    # A mask, not boolean indexing: indexing would wait for the GPU in every micro-batch.
    diff = torch.where(sel, (train_log_probs.detach() - mb.rollout_log_probs).abs(), 0.0)
    ratio = torch.where(sel, w.ratio, 0.0)
    return {
        "mismatch_abs_sum": diff.sum(),
        "mismatch_above_count": (diff > MISMATCH_THRESHOLD).sum().to(torch.float32),
        "mismatch_count": sel.sum().to(torch.float32),
        "mismatch_ratio_sum": ratio.sum(),
        "mismatch_ratio_max": ratio.max() if ratio.numel() else ratio.new_zeros(()),
        "mismatch_clip_count": w.clipped.sum().to(torch.float32),
        "mismatch_mask_count": w.masked.sum().to(torch.float32),
    }


def policy_loss(
    output_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    mb: MicroBatch,
    settings: LossSettings,
    old_log_probs: torch.Tensor | None,
    ref_log_probs: torch.Tensor | None,
    train_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO-clip loss of one micro-batch; ``old_log_probs`` None reuses current.detach() (seed step 38).

    The train/inference mismatch, and the TIS / MIS weight of each token's policy-gradient loss,
    compare rollout log-probs with ``train_log_probs`` (the recomputed pre-update log-probs) or,
    when none were recomputed, with the current ones (detached: before the update they are the
    same values).
    """
    log_probs, entropy = response_log_probs(
        output_logits,
        hidden,
        mb.index,
        mb.targets,
        settings.chunk_size,
        with_entropy=True,
        temperature=settings.temperature,
        entropy_grad=bool(settings.entropy_coef),
    )
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    ppo_kl = old - log_probs
    pg_loss, clipfrac = compute_policy_loss(
        ppo_kl, mb.advantages, settings.eps_clip, settings.eps_clip_high, settings.eps_clip_c
    )
    train = log_probs.detach() if train_log_probs is None else train_log_probs
    weights = correction_weights(train, mb, settings.correction)
    agg = _aggregate(mb, settings)
    loss = agg(pg_loss * weights.weight)
    metrics: Metrics = {
        "pg_loss": loss.detach(),
        "clipfrac": agg(clipfrac).detach(),
        "ppo_kl": agg(ppo_kl).detach(),
        "entropy": agg(entropy).detach(),
        "tokens": mb.loss_mask.sum().detach(),
    }
    if settings.entropy_coef:
        loss = loss - settings.entropy_coef * agg(entropy)
    if settings.kl_coef:
        if ref_log_probs is None:
            raise RuntimeError("kl_coef > 0 but no reference log-probs were computed")
        kl = agg(kl_penalty(log_probs, ref_log_probs, settings.kl_loss_type))
        loss = loss + settings.kl_coef * kl
        metrics["kl_loss"] = kl.detach()
    metrics["loss"] = loss.detach()
    metrics.update(mismatch_counts(train, mb, weights))
    return loss * settings.schedule_scale, metrics


def sft_loss(
    output_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    mb: MicroBatch,
    settings: LossSettings,
) -> tuple[torch.Tensor, Metrics]:
    """Cross-entropy on the response (label) tokens: the supervised warm-up before RL."""
    log_probs, _ = response_log_probs(
        output_logits,
        hidden,
        mb.index,
        mb.targets,
        settings.chunk_size,
        temperature=1.0,
    )
    loss = _aggregate(mb, settings)(-log_probs)
    return loss * settings.schedule_scale, {"loss": loss.detach(), "tokens": mb.loss_mask.sum().detach()}


def forward_log_probs(
    output_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    mb: MicroBatch,
    chunk_size: int,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """No-grad log-probs of one micro-batch (old or reference log-probs) at ``temperature``, as data."""
    log_probs, _ = response_log_probs(
        output_logits, hidden, mb.index, mb.targets, chunk_size, temperature=temperature
    )
    return hidden.new_zeros(()), {"log_probs": log_probs.detach()}
