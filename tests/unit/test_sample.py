"""Sample bookkeeping (seed steps 16, 19, 25)."""

from __future__ import annotations

import pytest

from vime.types import Sample, SampleStatus


def _prompt_sample(n_prompt: int = 200) -> Sample:
    return Sample(prompt="p", tokens=list(range(n_prompt)))


def test_append_response_tokens_seed_step_25() -> None:
    s = _prompt_sample()
    s.append_response_tokens(
        [101, 202, 151645],
        [-0.42, -1.10, -0.08],
        meta_info={"weight_version": "1", "finish_reason": {"type": "stop"}},
        text="abc",
    )
    assert len(s.tokens) == 203
    assert s.response_length == 3
    assert s.loss_mask == [1, 1, 1]
    assert s.rollout_log_probs == [-0.42, -1.10, -0.08]
    assert s.weight_version == "1"
    assert s.prompt_length == 200
    assert s.response_tokens == [101, 202, 151645]
    s.check_consistent()


def test_unequal_lengths_refused_and_nothing_changed() -> None:
    s = _prompt_sample(5)
    with pytest.raises(ValueError, match="3 tokens but 2 log-probs"):
        s.append_response_tokens([1, 2, 3], [-0.1, -0.2])
    assert s.response_length == 0 and len(s.tokens) == 5 and s.loss_mask == []


def test_mixing_chunks_with_and_without_logprobs_refused() -> None:
    s = _prompt_sample(5)
    s.append_response_tokens([1], [-0.5])
    with pytest.raises(ValueError, match="carries"):
        s.append_response_tokens([2])
    t = _prompt_sample(5)
    t.append_response_tokens([1])
    with pytest.raises(ValueError, match="has no"):
        t.append_response_tokens([2], [-0.1])


def test_untrainable_chunk_is_masked() -> None:
    s = _prompt_sample(2)
    s.append_response_tokens([7, 8])
    s.append_response_tokens([9], trainable=False)
    assert s.loss_mask == [1, 1, 0]
    assert s.rollout_log_probs is None


def test_remaining_tokens_reaches_zero_for_truncation() -> None:
    s = _prompt_sample(2)
    assert s.remaining_new_tokens(1024) == 1024
    s.append_response_tokens(list(range(1024)))
    assert s.remaining_new_tokens(1024) == 0


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        ("stop", SampleStatus.COMPLETED),
        ("length", SampleStatus.TRUNCATED),
        ("abort", SampleStatus.ABORTED),
        ("error", SampleStatus.FAILED),
        (None, SampleStatus.FAILED),
    ],
)
def test_status_from_finish_reason(reason: str | None, status: SampleStatus) -> None:
    assert SampleStatus.from_finish_reason(reason) is status


def test_sample_json_round_trip() -> None:
    s = _prompt_sample(3)
    s.append_response_tokens([4], [-1.0])
    s.status = SampleStatus.COMPLETED
    again = Sample.model_validate_json(s.model_dump_json())
    assert again == s
