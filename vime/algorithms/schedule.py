"""The DP schedule (seed step 31) and the old-log-prob reuse decision (seed step 38)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vime.config import RunConfig


@dataclass(frozen=True)
class DPSchedule:
    """Which samples each DP rank trains on, in which micro-batches, per optimizer step.

    ``partitions[r]`` lists rank r's sample indices in training order; ``micro_batch_indices[r]``
    splits them into micro-batches; ``num_microbatches[s]`` is the per-rank micro-batch count of
    step s (``[8]`` in the seed scenario, ``[2, 2, 2, 2]`` with four steps per rollout).
    """

    partitions: list[list[int]]
    micro_batch_indices: list[list[list[int]]]
    num_microbatches: list[int]
    global_batch_sizes: list[int]

    def rank_tokens(self, total_lengths: list[int]) -> list[int]:
        """Tokens each rank trains on (the quantity the schedule balances)."""
        return [sum(total_lengths[i] for i in part) for part in self.partitions]


def build_dp_schedule(
    total_lengths: list[int], global_batch_size: int, micro_batch_size: int, dp_size: int
) -> DPSchedule:
    """Split a rollout into optimizer steps, then each step's samples over DP ranks (seed step 31).

    num_steps = n // global_batch_size; each step has global_batch_size // micro_batch_size
    micro-batches, dp_size-th of them per rank. Within a step, samples go longest first to the
    rank with the fewest tokens that still has room (every rank gets the same count), so ranks
    finish together; each rank's samples are then cut into micro-batches of similar lengths.
    """
    n = len(total_lengths)
    if global_batch_size < 1 or micro_batch_size < 1 or dp_size < 1:
        raise ValueError("global_batch_size, micro_batch_size and dp_size must be >= 1")
    if n == 0 or n % global_batch_size:
        raise ValueError(f"{n} samples do not form whole steps of global_batch_size={global_batch_size}")
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size × dp_size "
            f"= {micro_batch_size * dp_size}"
        )
    per_rank = global_batch_size // dp_size
    partitions: list[list[int]] = [[] for _ in range(dp_size)]
    micro: list[list[list[int]]] = [[] for _ in range(dp_size)]
    num_microbatches: list[int] = []
    for step in range(n // global_batch_size):
        indices = range(step * global_batch_size, (step + 1) * global_batch_size)
        order = sorted(indices, key=lambda i: (-total_lengths[i], i))
        heap = [(0, r) for r in range(dp_size)]  # (tokens, rank) of ranks with room
        step_parts: list[list[int]] = [[] for _ in range(dp_size)]
        for i in order:
            tokens, r = heapq.heappop(heap)
            step_parts[r].append(i)
            if len(step_parts[r]) < per_rank:
                heapq.heappush(heap, (tokens + total_lengths[i], r))
        for r, part in enumerate(step_parts):
            partitions[r].extend(part)
            micro[r].extend(part[k : k + micro_batch_size] for k in range(0, per_rank, micro_batch_size))
        num_microbatches.append(per_rank // micro_batch_size)
    return DPSchedule(partitions, micro, num_microbatches, [global_batch_size] * len(num_microbatches))


def can_reuse_log_probs_in_loss(config: RunConfig, num_microbatches: list[int]) -> bool:
    """Whether the loss may use the current forward's detached log-probs as old log-probs (seed step 38).

    True only with a single optimizer step per rollout (the policy has not moved yet when the
    loss's forward runs), no KL term, no rollout log-probs and no mismatch metrics. The seed's other
    conditions (the policy loss, no critic, no OPD, not GSPO) always hold: the config offers
    nothing else. Otherwise the trainer first recomputes old log-probs with the current weights.
    """
    return (
        len(num_microbatches) == 1
        and config.kl_coef == 0
        and not config.use_rollout_logprobs
        and not config.get_mismatch_metrics
    )
