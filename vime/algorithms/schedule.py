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


def step_multiple(micro_batch_size: int, dp_size: int, max_tokens_per_gpu: int | None) -> tuple[int, str]:
    """What global_batch_size must be a multiple of, and its name for messages: micro_batch_size ×
    dp_size, or dp_size alone under a token budget (micro-batches then follow tokens)."""
    if max_tokens_per_gpu:
        return dp_size, f"DP size = {dp_size}"
    n = micro_batch_size * dp_size
    return n, f"micro_batch_size × DP size = {micro_batch_size} × {dp_size} = {n}"


def build_dp_schedule(
    total_lengths: list[int],
    global_batch_size: int,
    micro_batch_size: int,
    dp_size: int,
    max_tokens_per_gpu: int | None = None,
) -> DPSchedule:
    """Split a rollout into optimizer steps, then each step's samples over DP ranks (seed step 31).

    num_steps = n // global_batch_size. Within a step, samples go longest first to the rank with
    the fewest tokens that still has room (every rank gets the same count), so ranks finish
    together. Each rank's samples are then cut into micro-batches: without ``max_tokens_per_gpu``,
    global_batch_size // (micro_batch_size × dp_size) micro-batches of ``micro_batch_size``
    samples of similar lengths; with it, by tokens (`token_budget_micro_batches`).
    """
    n = len(total_lengths)
    if global_batch_size < 1 or micro_batch_size < 1 or dp_size < 1:
        raise ValueError("global_batch_size, micro_batch_size and dp_size must be >= 1")
    if max_tokens_per_gpu is not None and max_tokens_per_gpu < 1:
        raise ValueError(f"max_tokens_per_gpu={max_tokens_per_gpu} must be >= 1")
    if n == 0 or n % global_batch_size:
        raise ValueError(f"{n} samples do not form whole steps of global_batch_size={global_batch_size}")
    multiple, what = step_multiple(micro_batch_size, dp_size, max_tokens_per_gpu)
    if global_batch_size % multiple:
        raise ValueError(f"global_batch_size={global_batch_size} is not a multiple of {what}")
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
        if max_tokens_per_gpu:
            step_micro = token_budget_micro_batches(step_parts, total_lengths, max_tokens_per_gpu)
        else:
            step_micro = [
                [part[k : k + micro_batch_size] for k in range(0, per_rank, micro_batch_size)]
                for part in step_parts
            ]
        for r, mbs in enumerate(step_micro):
            partitions[r].extend(i for mb in mbs for i in mb)
            micro[r].extend(mbs)
        num_microbatches.append(len(step_micro[0]))
    return DPSchedule(partitions, micro, num_microbatches, [global_batch_size] * len(num_microbatches))


def token_budget_micro_batches(
    parts: list[list[int]], total_lengths: list[int], max_tokens: int
) -> list[list[list[int]]]:
    """Each rank's samples of one step in k micro-batches of at most ``max_tokens`` tokens each.

    ``parts`` hold the same number of samples. k is the same for every rank (Megatron's schedule
    runs as many micro-batches on each, as slime's dynamic batch size does): the
    largest first-fit-decreasing count over the ranks, raised until a longest-first greedy
    balance (each sample to the micro-batch with the fewest tokens) keeps every micro-batch of
    two or more samples within the budget. A sample longer than the budget is a micro-batch alone.
    The loss does not depend on the split: it is normalised by the global batch size.
    """

    def first_fit(part: list[int]) -> int:
        bins: list[int] = []
        for i in sorted(part, key=lambda i: -total_lengths[i]):
            for b, used in enumerate(bins):
                if used + total_lengths[i] <= max_tokens:
                    bins[b] += total_lengths[i]
                    break
            else:
                bins.append(total_lengths[i])
        return len(bins)

    def balance(part: list[int], k: int) -> list[list[int]] | None:
        heap = [(0, b) for b in range(k)]
        bins: list[list[int]] = [[] for _ in range(k)]
        for i in sorted(part, key=lambda i: (-total_lengths[i], i)):
            tokens, b = heapq.heappop(heap)
            if bins[b] and tokens + total_lengths[i] > max_tokens:
                return None
            bins[b].append(i)
            heapq.heappush(heap, (tokens + total_lengths[i], b))
        return bins

    # Ranks hold equally many samples; with k = that many, every micro-batch is one sample.
    k = min(max(first_fit(p) for p in parts), len(parts[0]))
    while True:
        balanced = [balance(p, k) for p in parts]
        if all(b is not None for b in balanced):
            return [b for b in balanced if b is not None]
        k += 1


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
