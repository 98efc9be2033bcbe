"""The rollout batch format: columns from Samples, the DP split of seed step 31, the rank blob."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from vime.algorithms import build_dp_schedule, normalize_group_rewards
from vime.batch import (
    BatchFormatError,
    RankBatch,
    RolloutBatch,
    decode_rank_batch,
    encode_rank_batch,
    split_by_dp,
)
from vime.types import Sample, SampleStatus

N_SAMPLES, GROUP = 256, 8


def make_samples(n: int = N_SAMPLES, seed: int = 0) -> list[Sample]:
    """The seed's rollout shape: 32 groups × 8 samples, varied lengths, and the awkward cases."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        s = Sample(
            tokens=[rng.randrange(151_000) for _ in range(rng.randint(5, 60))],
            index=i,
            group_index=i // GROUP,
            weight_version=str(3 + i % 2),
            reward=float(rng.random() < 0.5),
        )
        r = 0 if i == 17 else rng.randint(1, 120)  # sample 17: zero-length response
        with_lp = i % 5 != 0  # every fifth sample carries no log-probs -> NaN in the column
        lps = [rng.uniform(-9, 0) for _ in range(r)] if with_lp else None
        if lps and i == 3:
            lps[0] = math.nan  # an engine-reported NaN must survive too
        s.append_response_tokens([rng.randrange(151_000) for _ in range(r)], lps)
        if i % 11 == 0 and r:  # a masked tail (e.g. a tool response)
            s.append_response_tokens([7, 8, 9], [-0.5] * 3 if with_lp else None, trainable=False)
        s.status = SampleStatus.TRUNCATED if i % 13 == 0 else SampleStatus.COMPLETED
        samples.append(s)
    return samples


def make_batch(samples: list[Sample]) -> RolloutBatch:
    rewards = [s.reward or 0.0 for s in samples]
    return RolloutBatch.from_samples(
        samples,
        batch_id="run-a:0:0",
        run_id="run-a",
        rollout_id=0,
        weight_version=4,
        advantages=normalize_group_rewards(rewards, GROUP),
        metrics={"rollout/response_len_mean": 60.5, "rollout/kept_groups": 32},
    )


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_from_samples_keeps_every_field_of_every_sample() -> None:
    samples = make_samples()
    batch = make_batch(samples)
    assert batch.num_samples == 256
    assert batch.total_lengths().tolist() == [len(s.tokens) for s in samples]
    for i, s in enumerate(samples):
        row = batch.sample(i)
        assert row.tokens.tolist() == s.tokens
        assert row.prompt_length == s.prompt_length
        assert row.loss_mask.tolist() == s.loss_mask
        if s.rollout_log_probs is None:
            assert row.rollout_log_probs is None
        else:
            assert np.array_equal(row.rollout_log_probs, np.float32(s.rollout_log_probs), equal_nan=True)
        assert (row.index, row.group_index, row.status) == (s.index, s.group_index, s.status)
        assert row.weight_version == int(s.weight_version or -1)
        assert row.truncated == (s.status == SampleStatus.TRUNCATED)
        assert row.reward == s.reward
    # the response-token NaNs sit exactly where a sample carries no log-probs (plus sample 3's own)
    expected_nan = [
        True if s.rollout_log_probs is None else math.isnan(x)
        for s in samples
        for x in (s.rollout_log_probs or [0.0] * s.response_length)
    ]
    assert np.isnan(batch.rollout_log_probs).tolist() == expected_nan
    assert sum(expected_nan) > 256 and expected_nan.count(True) < len(expected_nan)
    assert batch.sample(17).response_length == 0 and batch.sample(17).loss_mask.size == 0
    assert not batch.has_rollout_log_probs[0] and batch.has_rollout_log_probs[3]


def test_seed_group_normalisation_lands_in_the_advantages_column() -> None:
    samples = make_samples(8)
    for s, r in zip(samples, [1, 0, 0, 1, 1, 0, 1, 0], strict=True):
        s.reward = float(r)
    batch = make_batch(samples)
    assert batch.rewards.tolist() == [1, 0, 0, 1, 1, 0, 1, 0]
    assert np.allclose(batch.advantages, [0.9354 * (2 * r - 1) for r in [1, 0, 0, 1, 1, 0, 1, 0]], atol=1e-4)


def test_seed_split_256_samples_over_4_ranks_in_8_micro_batches() -> None:
    batch = make_batch(make_samples())
    schedule = build_dp_schedule(batch.total_lengths().tolist(), 256, 8, 4)
    shares = split_by_dp(batch, schedule)
    assert [rb.dp_rank for rb in shares] == [0, 1, 2, 3]
    seen: list[int] = []
    for rb in shares:
        assert rb.num_samples == 64 and rb.dp_size == 4 and rb.global_batch_size == 256
        assert rb.num_microbatches == [8]
        assert rb.micro_batches == [(k * 8, k * 8 + 8) for k in range(8)]
        # training order is the schedule's, and each row is the original sample, intact
        assert rb.sample_indices.tolist() == schedule.partitions[rb.dp_rank]
        for row in range(rb.num_samples):
            assert_row_is_sample(rb, row, batch)
        seen.extend(rb.sample_indices.tolist())
    assert sorted(seen) == list(range(256))


def test_four_steps_per_rollout_split_two_micro_batches_per_step() -> None:
    batch = make_batch(make_samples())
    schedule = build_dp_schedule(batch.total_lengths().tolist(), 64, 8, 4)
    for rb in split_by_dp(batch, schedule):
        assert rb.num_samples == 64 and rb.global_batch_size == 64
        assert rb.num_microbatches == [2, 2, 2, 2]
        assert len(rb.micro_batches) == 8
        for k in range(8):  # micro-batches 2s, 2s+1 hold only samples of optimizer step s
            step = k // 2
            mb = rb.micro_batch(k)
            assert mb.num_samples == 8
            assert all(step * 64 <= i < (step + 1) * 64 for i in mb.sample_indices.tolist())
            start = rb.micro_batches[k][0]
            for j in range(mb.num_samples):
                assert same_bits(mb.sample(j).tokens, rb.sample(start + j).tokens)


def assert_row_is_sample(rb: RankBatch, row: int, batch: RolloutBatch) -> None:
    got, want = rb.sample(row), batch.sample(int(rb.sample_indices[row]))
    assert same_bits(got.tokens, want.tokens)
    assert same_bits(got.loss_mask, want.loss_mask)
    assert (got.rollout_log_probs is None) == (want.rollout_log_probs is None)
    if got.rollout_log_probs is not None and want.rollout_log_probs is not None:
        assert same_bits(got.rollout_log_probs, want.rollout_log_probs)
    assert (got.advantage, got.weight_version, got.status) == (
        want.advantage,
        want.weight_version,
        want.status,
    )


def test_rank_blobs_round_trip_bit_for_bit() -> None:
    batch = make_batch(make_samples())
    shares = split_by_dp(batch, build_dp_schedule(batch.total_lengths().tolist(), 256, 8, 4))
    for rb in shares:
        back = decode_rank_batch(encode_rank_batch(rb))
        for name, col in rb.columns().items():
            assert same_bits(back.columns()[name], col), name
        for name in ("batch_id", "run_id", "rollout_id", "weight_version", "dp_rank", "dp_size"):
            assert getattr(back, name) == getattr(rb, name)
        assert back.micro_batches == rb.micro_batches and back.num_microbatches == [8]
        assert back.metrics == {"rollout/response_len_mean": 60.5, "rollout/kept_groups": 32.0}
        assert back.tokens.flags.writeable  # usable by torch.from_numpy without a copy
    # the zero-length response and the NaN log-probs made it through
    by_index = {int(i): (rb, r) for rb in shares for r, i in enumerate(rb.sample_indices)}
    rb17, row17 = by_index[17]
    assert decode_rank_batch(encode_rank_batch(rb17)).sample(row17).response_length == 0
    rb3, row3 = by_index[3]
    lp = decode_rank_batch(encode_rank_batch(rb3)).sample(row3).rollout_log_probs
    assert lp is not None and math.isnan(lp[0])


def one_share() -> RankBatch:
    batch = make_batch(make_samples(16))
    return split_by_dp(batch, build_dp_schedule(batch.total_lengths().tolist(), 16, 4, 2))[0]


def tamper(mutate: Callable[[dict[str, Any]], None]) -> bytes:
    env = msgspec.msgpack.decode(encode_rank_batch(one_share()))
    mutate(env)
    return msgspec.msgpack.encode(env)


def _shift_offsets(env: dict[str, Any]) -> None:
    offs = np.frombuffer(env["arrays"]["token_offsets"]["data"], dtype=np.int64).copy()
    offs[3] = offs[4] + 1  # decreasing
    env["arrays"]["token_offsets"]["data"] = offs.tobytes()


BAD_BLOBS: list[tuple[str, Callable[[], bytes], str]] = [
    ("truncated", lambda: encode_rank_batch(one_share())[:-100], "truncated"),
    ("empty", lambda: b"", "truncated"),
    ("not msgpack map", lambda: b"\x93\x01\x02\x03", "Expected `object`"),
    ("wrong magic", lambda: tamper(lambda e: e.update(magic="something-else")), "magic"),
    ("future version", lambda: tamper(lambda e: e.update(version=99)), "version 99"),
    ("missing field", lambda: tamper(lambda e: e.pop("micro_batches")), "micro_batches"),
    ("missing array", lambda: tamper(lambda e: e["arrays"].pop("loss_masks")), "loss_masks"),
    (
        "dtype mismatch",
        lambda: tamper(lambda e: e["arrays"]["tokens"].update(dtype="<i8")),
        "'tokens': dtype '<i8'",
    ),
    (
        "byte length mismatch",
        lambda: tamper(lambda e: e["arrays"]["rewards"].update(data=e["arrays"]["rewards"]["data"][:-4])),
        "'rewards': .* data bytes",
    ),
    (
        "shape mismatch",
        lambda: tamper(lambda e: e["arrays"]["advantages"].update(shape=[2, 4])),
        "'advantages': shape",
    ),
    ("offsets inconsistent", lambda: tamper(_shift_offsets), "token_offsets inconsistent"),
    (
        "micro-batches not covering the rows",
        lambda: tamper(lambda e: e.update(micro_batches=[[0, 4]])),
        "micro_batches cover 4 rows of 8",
    ),
]


@pytest.mark.parametrize(("make_blob", "message"), [b[1:] for b in BAD_BLOBS], ids=[b[0] for b in BAD_BLOBS])
def test_malformed_blob_is_refused_with_a_clear_message(make_blob: Callable[[], bytes], message: str) -> None:
    with pytest.raises(BatchFormatError, match=message):
        decode_rank_batch(make_blob())


def test_inconsistent_input_is_refused() -> None:
    samples = make_samples(8)
    with pytest.raises(ValueError, match="8 samples but 7 advantages"):
        RolloutBatch.from_samples(
            samples, batch_id="b", run_id="r", rollout_id=0, weight_version=0, advantages=[0.0] * 7
        )
    samples[2].loss_mask.append(1)
    with pytest.raises(ValueError, match=r"sample 2 .*loss_mask"):
        make_batch(samples)
    batch = make_batch(make_samples(16))
    other = build_dp_schedule(list(range(1, 33)), 32, 4, 2)  # built for 32 samples, not 16
    with pytest.raises(ValueError, match="was it built for this batch"):
        split_by_dp(batch, other)
