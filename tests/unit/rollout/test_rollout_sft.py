"""Supervised warm-up batches: which prompts a step takes, what its responses are (the label as text
+ EOS, all in the loss mask), what labels are refused, and the batch and DP split they make."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from vime_rollout.batch_builder import BatchBuildError
from vime_rollout.data import DataSource, build_dataset
from vime_rollout.data.synthetic import arithmetic_records
from vime_rollout.sft import SftExamples, SftLabelError, build_sft_batch, label_text

from vime.config import RunConfig, load_config
from vime.types import SampleStatus

COMMON = {
    "input_key": "prompt",
    "label_key": "label",
    "metadata_key": "metadata",
    "apply_chat_template": False,
}


def _examples(tokenizer: Any, records: list[dict[str, Any]], **kw: Any) -> SftExamples:
    dataset = build_dataset("d", records, tokenizer, max_prompt_len=64, **COMMON)
    opts = {"label_key": "label", "max_response_len": 8, "shuffle": True, "seed": 3, **kw}
    return SftExamples(dataset, tokenizer, **opts)


def _cfg(**over: Any) -> RunConfig:
    base = {
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 4,
        "micro_batch_size": 2,
        "rollout_num_gpus": 0,
        "actor_num_gpus_per_node": 0,
        "actor_num_cpu_ranks": 2,
        "tensor_model_parallel_size": 1,
        **over,
    }
    return load_config(overrides=[f"{k}={v}" for k, v in base.items()], environ={})


def test_labels_are_text_or_numbers_and_nothing_else() -> None:
    assert label_text("46", "label") == "46" and label_text(46, "label") == "46"
    assert label_text(2.5, "label") == "2.5"
    for bad in (None, True, "  ", {"answer": 1}, [1, 2]):
        with pytest.raises(SftLabelError, match=r"data.label_key='label'"):
            label_text(bad, "label")


def test_an_arithmetic_sample_is_the_prompt_then_the_sum_and_eos(tokenizer: Any) -> None:
    sft = _examples(tokenizer, list(arithmetic_records(20, 1)), shuffle=False)
    samples = sft.samples(0, 4)
    record = next(iter(arithmetic_records(1, 1)))
    s = samples[0]
    assert tokenizer.decode(s.tokens[: s.prompt_length]) == record["prompt"]
    assert tokenizer.decode(s.response_tokens) == f"{record['label']}<|endoftext|>"
    assert s.response_tokens[-1] == tokenizer.eos_token_id
    assert s.loss_mask == [1] * s.response_length and s.reward == 1.0
    assert s.status is SampleStatus.COMPLETED and [x.index for x in samples] == [0, 1, 2, 3]


def test_steps_take_consecutive_slices_of_their_own_order_over_epochs(tokenizer: Any) -> None:
    records = list(arithmetic_records(20, 1))
    sft = _examples(tokenizer, records)
    prompts = [s.prompt for step in range(5) for s in sft.samples(step, 8)]  # 40 = two epochs
    assert sorted(prompts[:20]) == sorted(prompts[20:]) == sorted(r["prompt"] for r in records)
    assert prompts[:20] != prompts[20:]  # each epoch reshuffled
    assert prompts[:20] != [r["prompt"] for r in records]  # shuffled at all
    again = _examples(tokenizer, records)
    assert [s.prompt for s in again.samples(3, 8)] == prompts[24:32]  # a step asked again: same prompts
    assert [s.index for s in again.samples(3, 8)] == list(range(24, 32))


def test_the_warm_up_does_not_move_the_rl_data_position(tokenizer: Any) -> None:
    dataset = build_dataset("d", arithmetic_records(20, 1), tokenizer, max_prompt_len=64, **COMMON)
    source = DataSource(dataset, 4, seed=1)
    before = source.state_dict()
    SftExamples(dataset, tokenizer, label_key="label", max_response_len=8, shuffle=True, seed=1).samples(0, 8)
    assert source.state_dict() == before


def test_a_long_label_is_cut_at_the_response_limit(tokenizer: Any) -> None:
    sft = _examples(tokenizer, [{"prompt": "say:", "label": "abcdefghijkl"}], max_response_len=5)
    s = sft.samples(0, 1)[0]
    assert tokenizer.decode(s.response_tokens) == "abcde" and s.response_length == 5


def test_a_label_that_is_not_text_is_refused_naming_the_key(tokenizer: Any) -> None:
    sft = _examples(tokenizer, [{"prompt": "x=", "label": {"tests": [1]}}])
    with pytest.raises(SftLabelError, match="not text the model should emit"):
        sft.samples(0, 1)


def test_the_batch_is_one_step_split_by_dp_with_advantage_one(tokenizer: Any) -> None:
    cfg = _cfg()
    samples = _examples(tokenizer, list(arithmetic_records(20, 1))).samples(2, cfg.global_batch_size or 0)
    built = build_sft_batch(cfg, samples, batch_id="r:sft:2:0", run_id="r:sft", step=2, dp_size=2)
    b = built.batch
    assert b.num_samples == 8 and b.rollout_id == 2 and b.run_id == "r:sft"
    assert np.all(b.advantages == 1.0) and np.all(b.rewards == 1.0) and np.all(b.loss_masks == 1)
    assert b.metrics["sft/label_len_mean"] == pytest.approx(np.mean(b.response_lengths))
    assert [sh.dp_rank for sh in built.shares] == [0, 1]
    assert all(sh.num_microbatches == [2] and sh.global_batch_size == 8 for sh in built.shares)
    assert sorted(i for sh in built.shares for i in sh.sample_indices) == list(range(16, 24))
    with pytest.raises(BatchBuildError, match="dp_size=3"):
        build_sft_batch(cfg, samples, batch_id="x", run_id="r:sft", step=2, dp_size=3)
