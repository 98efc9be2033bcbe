"""A RankBatch micro-batch as the padded tensors and response-token index the loss uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vime_trainer.megatron.micro_batch import make_micro_batch

from vime.algorithms import build_dp_schedule
from vime.batch import RolloutBatch, split_by_dp
from vime.types import Sample, SampleStatus


def _batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    advantages: list[float],
    log_probs: list[list[float] | None] | None = None,
) -> RolloutBatch:
    samples = [
        Sample(
            tokens=p + r,
            response_length=len(r),
            loss_mask=[1] * len(r),
            rollout_log_probs=None if log_probs is None else log_probs[i],
            reward=1.0,
            status=SampleStatus.COMPLETED,
            index=i,
            group_index=0,
        )
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
    ]
    return RolloutBatch.from_samples(
        samples, batch_id="b", run_id="r", rollout_id=0, weight_version=1, advantages=advantages
    )


def test_response_tokens_are_predicted_from_the_previous_position() -> None:
    batch = _batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], [0.9354, -0.9354])
    mb = make_micro_batch(batch.rows(0, 2), "cpu")
    assert mb.tokens.tolist() == [[1, 2, 3, 5, 6], [4, 7, 8, 9, 0]]  # right-padded
    assert mb.response_lengths == [2, 3]
    b = 2
    # hidden is [s, b, h]; sample 0 predicts 5 at position 2 and 6 at 3; sample 1 predicts 7, 8, 9 at 0, 1, 2
    assert mb.index.tolist() == [2 * b + 0, 3 * b + 0, 0 * b + 1, 1 * b + 1, 2 * b + 1]
    assert mb.targets.tolist() == [5, 6, 7, 8, 9]
    assert mb.sample_index is not None and mb.sample_index.tolist() == [0, 0, 1, 1, 1]
    flat_tokens = mb.tokens.t().reshape(-1)  # the same [s, b] flattening as the hidden states
    assert (flat_tokens[mb.index + b] == mb.targets).all()  # one position later holds the target
    assert mb.advantages.tolist() == pytest.approx(
        [0.9354, 0.9354, -0.9354, -0.9354, -0.9354]
    )  # seed step 39
    assert mb.position_ids.tolist()[1] == [0, 1, 2, 3, 4]
    assert mb.causal_mask().shape == (1, 1, 5, 5) and bool(mb.causal_mask()[0, 0, 0, 1])


def test_packed_samples_are_one_sequence_with_per_sample_positions() -> None:
    batch = _batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], [0.9354, -0.9354])
    padded = make_micro_batch(batch.rows(0, 2), "cpu")
    mb = make_micro_batch(batch.rows(0, 2), "cpu", packed=True)
    assert mb.tokens.tolist() == [[1, 2, 3, 5, 6, 4, 7, 8, 9]]  # no padding
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]  # RoPE restarts per sample
    assert mb.packing is not None and mb.packing.qkv_format == "sbhd"
    assert mb.packing.cu_seqlens_q.tolist() == [0, 5, 9] and mb.packing.cu_seqlens_q.dtype == torch.int32
    assert mb.packing.bounds == (0, 5, 9) and mb.packing.max_seqlen_q == 5
    # hidden is [T, 1, h]: sample 0 predicts 5, 6 at 2, 3; sample 1 predicts 7, 8, 9 at 5 + 0, 1, 2
    assert mb.index.tolist() == [2, 3, 5, 6, 7]
    assert (mb.tokens[0, mb.index + 1] == mb.targets).all()
    for name in ("targets", "loss_mask", "advantages", "has_rollout_log_probs", "sample_index"):
        assert torch.equal(getattr(mb, name), getattr(padded, name)), name  # same per-token arrays
    assert (mb.micro_batch_size, mb.seq_length) == (1, 9)
    assert (padded.micro_batch_size, padded.seq_length) == (2, 5)
    assert mb.real_tokens == padded.real_tokens == mb.padded_tokens == 9 and padded.padded_tokens == 10
    with pytest.raises(ValueError, match="padded micro-batches only"):
        mb.causal_mask()


def test_rollout_log_probs_are_marked_per_token() -> None:
    batch = _batch([[1, 2], [3, 4]], [[5], [6, 7]], [1.0, -1.0], log_probs=[None, [-0.5, -0.25]])
    mb = make_micro_batch(batch.rows(0, 2), "cpu")
    assert mb.has_rollout_log_probs.tolist() == [False, True, True]
    assert torch.isnan(mb.rollout_log_probs[0]) and mb.rollout_log_probs[1:].tolist() == [-0.5, -0.25]


def test_rank_batch_micro_batches_follow_the_schedule() -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 100, size=int(rng.integers(2, 6))).tolist() for _ in range(8)]
    responses = [rng.integers(3, 100, size=int(rng.integers(1, 5))).tolist() for _ in range(8)]
    batch = _batch(prompts, responses, [0.9354] * 8)
    schedule = build_dp_schedule(batch.total_lengths().tolist(), 8, 2, 2)
    rb0, _ = split_by_dp(batch, schedule)
    mbs = [make_micro_batch(rb0.micro_batch(k), "cpu") for k in range(len(rb0.micro_batches))]
    assert rb0.num_microbatches == [2] and len(mbs) == 2
    assert sum(mb.num_samples for mb in mbs) == 4
    assert sum(int(mb.loss_mask.sum()) for mb in mbs) == int(rb0.loss_masks.sum())


def test_a_sample_without_prompt_is_refused() -> None:
    batch = _batch([[]], [[5, 6]], [1.0])
    with pytest.raises(ValueError, match="no prompt token"):
        make_micro_batch(batch.rows(0, 1), "cpu")


def test_sft_examples_become_label_only_loss_batches() -> None:
    from vime_trainer.megatron.sft import sft_rank_batches

    from vime.config import load_config

    cfg = load_config(
        base={
            "rollout_batch_size": 2,
            "n_samples_per_prompt": 2,
            "micro_batch_size": 1,
            "actor_num_gpus_per_node": 0,
            "actor_num_cpu_ranks": 2,
            "tensor_model_parallel_size": 1,
            "rollout_num_gpus": 0,
            "colocate": False,
        },
        environ={},
    )
    examples = [([1, 2, 3], [4]), ([5], [6, 7]), ([8, 9], [10]), ([11], [12, 13, 14])]
    rbs = sft_rank_batches(examples, cfg, step=3)
    assert [rb.dp_rank for rb in rbs] == [0, 1] and all(rb.rollout_id == 3 for rb in rbs)
    assert sorted(int(n) for rb in rbs for n in rb.response_lengths) == [1, 1, 2, 3]
    assert all(rb.loss_masks.all() for rb in rbs)
    with pytest.raises(ValueError, match="non-empty prompt"):
        sft_rank_batches([([], [1]), *examples[1:]], cfg)
