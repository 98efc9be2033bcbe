"""The rollout loop's pieces (seed steps 16–28) against in-process stand-ins of router and reward."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rollout_fakes import FakeGenerator, FakeScorer, vllm_reply
from vime_rollout.data import DataSource, build_dataset
from vime_rollout.data.synthetic import arithmetic_records
from vime_rollout.filters import check_reward_nonzero_std
from vime_rollout.rollout.generate import generate, request_payload
from vime_rollout.rollout.loop import RolloutError, generate_rollout
from vime_rollout.rollout.state import GenerateState, SamplingSettings, logprobs_wanted

from vime.clients.base import ServiceCallError
from vime.config import RunConfig, load_config
from vime.types import Sample, SampleStatus


def _cfg(**over: Any) -> RunConfig:
    base = {
        "rollout_batch_size": 4,
        "n_samples_per_prompt": 8,
        "rollout_max_response_len": 16,
        "rollout_max_context_len": 600,
        "rollout_num_gpus": 0,
        "actor_num_gpus_per_node": 0,
        "tensor_model_parallel_size": 1,
        "colocate": False,
    }
    return load_config(overrides=[f"{k}={v}" for k, v in {**base, **over}.items()])


def _state(
    cfg: RunConfig, tokenizer: Any, gen: FakeGenerator, scorer: FakeScorer, **kw: Any
) -> GenerateState:
    return GenerateState(
        cfg=cfg,
        tokenizer=tokenizer,
        generator=gen,
        scorer=scorer,
        model_name="tiny",
        sampling=SamplingSettings.for_training(cfg),
        concurrency=kw.pop("concurrency", 64),
        weight_version=lambda: 3,
        abort_engines=gen.abort,
        **kw,
    )


def _source(cfg: RunConfig, tokenizer: Any, n_prompts: int = 64) -> DataSource:
    ds = build_dataset(
        "arith",
        arithmetic_records(n_prompts, seed=1),
        tokenizer,
        input_key="prompt",
        label_key="label",
        metadata_key="metadata",
        apply_chat_template=False,
        max_prompt_len=cfg.rollout_max_prompt_len,
    )
    return DataSource(ds, cfg.n_samples_per_prompt, seed=cfg.rollout_seed)


def _run(state: GenerateState, src: DataSource, **kw: Any) -> Any:
    cfg = state.cfg
    return asyncio.run(
        generate_rollout(
            state,
            0,
            src.get_samples,
            target=cfg.rollout_batch_size,
            over_sampling=cfg.over_sampling_batch_size or cfg.rollout_batch_size,
            progress=False,
            **kw,
        )
    )


def test_seed_step_19_request_shape(tokenizer: Any) -> None:
    cfg = _cfg(rollout_max_response_len=1024, rollout_max_context_len=4096)
    state = _state(cfg, tokenizer, FakeGenerator(), FakeScorer(lambda s: 1))
    sample = Sample(tokens=list(range(200)))
    assert request_payload(state, sample, 1024, 0) == {
        "model": "tiny",
        "token_ids": list(range(200)),
        "sampling_params": {
            "max_tokens": 1024,
            "temperature": 1.0,
            "top_p": 1.0,
            "output_kind": 2,
            "logprobs": 0,
            "flat_logprobs": True,
            "top_k": -1,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "detokenize": False,
        },
    }
    assert "logprobs" not in request_payload(state, sample, 1024, None)["sampling_params"]


def test_logprobs_only_when_consumed() -> None:
    assert logprobs_wanted(_cfg(), 0) is None
    assert logprobs_wanted(_cfg(use_rollout_logprobs=True), 0) == 0  # the sampled token's only
    assert logprobs_wanted(_cfg(get_mismatch_metrics=True), 5) == 0
    assert logprobs_wanted(_cfg(use_tis=True, rollout_logprobs_fraction=0.01), 5) == 0  # every group
    assert logprobs_wanted(_cfg(use_mis=True, rollout_logprobs_fraction=0.01), 7) == 0
    assert logprobs_wanted(_cfg(score_centering_top_k=4), 5) == 5
    picked = [g for g in range(2000) if logprobs_wanted(_cfg(rollout_logprobs_fraction=0.25), g) is not None]
    assert 400 < len(picked) < 600
    assert picked == [
        g for g in range(2000) if logprobs_wanted(_cfg(rollout_logprobs_fraction=0.25), g) is not None
    ]


def test_four_prompts_times_eight_samples(tokenizer: Any) -> None:
    cfg = _cfg()
    gen, scorer = FakeGenerator(), FakeScorer(lambda s: float(s.index % 2))
    state = _state(cfg, tokenizer, gen, scorer)
    out = _run(state, _source(cfg, tokenizer))
    assert len(out.groups) == 4 and all(len(g) == 8 for g in out.groups)
    assert sorted(s.index for g in out.groups for s in g) == list(range(32))
    for g in out.groups:
        assert len({s.group_index for s in g}) == 1
        for s in g:
            assert s.status is SampleStatus.COMPLETED and s.response_length == 3
            assert s.loss_mask == [1, 1, 1] and s.rollout_log_probs is None
            assert s.reward == float(s.index % 2) and s.weight_version == "3"
            assert s.response == tokenizer.decode(s.response_tokens)
    assert scorer.calls == [1] * 32
    assert len(gen.requests) == 32 and all(sid is None for _, sid in gen.requests)
    assert out.aborted_groups == []


def test_the_rollout_times_its_parts(tokenizer: Any) -> None:
    """``rollout/t_*``: sends, replies, rewards and the last group, in the order they must happen."""
    from vime_rollout.rollout.metrics import rollout_metrics

    cfg = _cfg(rollout_batch_size=8)
    state = _state(cfg, tokenizer, FakeGenerator(delay_s=0.01), FakeScorer(lambda s: 1), concurrency=16)
    out = _run(state, _source(cfg, tokenizer))
    m = rollout_metrics(out.groups, state.counters, out.wall_s)
    t = {
        k.removeprefix("rollout/t_").removesuffix("_s"): v for k, v in m.items() if k.startswith("rollout/t_")
    }
    assert t["first_request"] <= t["last_request"] <= t["last_response"] <= t["last_group"] <= out.wall_s
    assert t["first_request"] <= t["first_response"] <= t["median_response"] <= t["last_response"]
    assert t["reward_total"] > 0 and t["reward_tail"] == t["last_group"] - t["last_response"]
    assert t["abort"] >= 0 and len(state.counters.clock.responses) == 64


def test_semaphore_bounds_requests_in_flight(tokenizer: Any) -> None:
    cfg = _cfg(rollout_batch_size=8)
    gen = FakeGenerator(delay_s=0.01)
    _run(_state(cfg, tokenizer, gen, FakeScorer(lambda s: 1), concurrency=5), _source(cfg, tokenizer))
    assert gen.max_in_flight == 5


def test_session_header_only_with_consistent_hash(tokenizer: Any) -> None:
    cfg = _cfg(**{"router.policy": "consistent_hash"})
    gen = FakeGenerator()
    out = _run(_state(cfg, tokenizer, gen, FakeScorer(lambda s: 1)), _source(cfg, tokenizer))
    sessions = {s.session_id for g in out.groups for s in g}
    assert {sid for _, sid in gen.requests} == sessions and len(sessions) == 32


def test_group_rm_scores_each_group_in_one_call(tokenizer: Any) -> None:
    cfg = _cfg(**{"reward.group_rm": True})
    scorer = FakeScorer(lambda s: 1.0)
    _run(_state(cfg, tokenizer, FakeGenerator(), scorer), _source(cfg, tokenizer))
    assert scorer.calls == [8, 8, 8, 8]


def test_filter_drops_groups_and_resamples_until_full(tokenizer: Any) -> None:
    cfg = _cfg(over_sampling_batch_size=3)
    # Groups with an even group_index all score 1 (zero std): the filter drops them.
    scorer = FakeScorer(lambda s: 1.0 if s.group_index % 2 == 0 else float(s.index % 2))
    gen = FakeGenerator()
    state = _state(cfg, tokenizer, gen, scorer)
    out = _run(state, _source(cfg, tokenizer), dynamic_filter=check_reward_nonzero_std)
    assert len(out.groups) == 4
    assert all(g[0].group_index % 2 == 1 for g in out.groups)
    c = state.counters
    assert c.groups_dropped >= 4 and c.drop_reasons == {"zero_std_1": c.groups_dropped}
    assert c.groups_submitted % 3 == 0 and c.groups_submitted >= 8


def test_filter_that_drops_everything_fails_instead_of_looping(tokenizer: Any) -> None:
    cfg = _cfg(rollout_batch_size=1, n_samples_per_prompt=2, micro_batch_size=1)
    state = _state(cfg, tokenizer, FakeGenerator(delay_s=0), FakeScorer(lambda s: 0.0))
    with pytest.raises(RolloutError, match="dynamic filter dropped"):
        _run(state, _source(cfg, tokenizer), dynamic_filter=check_reward_nonzero_std)


def test_leftovers_are_aborted_and_returned(tokenizer: Any) -> None:
    cfg = _cfg(over_sampling_batch_size=6, partial_rollout=True)
    gen = FakeGenerator()
    gen.hold_after = 32  # the first four groups finish; the other two hang until aborted
    state = _state(cfg, tokenizer, gen, FakeScorer(lambda s: float(s.index % 2)))
    out = _run(state, _source(cfg, tokenizer))
    assert sorted(g[0].group_index for g in out.groups) == [0, 1, 2, 3]
    assert state.aborted and gen.abort_event.is_set()
    assert sorted(g[0].group_index for g in out.aborted_groups) == [4, 5]
    for s in (s for g in out.aborted_groups for s in g):
        # Partial output kept for continuation; no reward for an unfinished sample.
        assert s.status is SampleStatus.ABORTED and s.response_length == 1 and s.reward is None
    assert state.counters.aborted_samples == 16


def test_truncated_when_no_tokens_are_left(tokenizer: Any) -> None:
    cfg = _cfg(rollout_max_response_len=4)
    gen = FakeGenerator()
    state = _state(cfg, tokenizer, gen, FakeScorer(lambda s: 1))
    s = Sample(tokens=[1, 2, 3])
    s.append_response_tokens([4, 5, 6, 7])
    out = asyncio.run(generate(state, s, None))
    assert out.status is SampleStatus.TRUNCATED and gen.requests == []
    # A partial sample asks only for what is left: 4 - 2 = 2 tokens.
    p = Sample(tokens=[1, 2, 3])
    p.append_response_tokens([4, 5])
    out = asyncio.run(generate(state, p, None))
    assert gen.requests[-1][0]["sampling_params"]["max_tokens"] == 2
    assert gen.requests[-1][0]["token_ids"] == [1, 2, 3, 4, 5]
    assert out.response_length == 4 and out.loss_mask == [1, 1, 1, 1]


def test_engine_side_abort_is_retried_and_version_read_from_engine(tokenizer: Any) -> None:
    cfg = _cfg()
    gen = FakeGenerator()
    gen.fail_next = [vllm_reply([31], "abort", True), vllm_reply([31, 32], "length", True, version="7")]
    state = _state(cfg, tokenizer, gen, FakeScorer(lambda s: 1))
    out = asyncio.run(generate(state, Sample(tokens=[1, 2]), 1))
    assert len(gen.requests) == 2 and state.counters.engine_aborts_retried == 1
    assert out.tokens == [1, 2, 31, 32] and out.rollout_log_probs == [-0.5, -0.5]
    assert out.status is SampleStatus.TRUNCATED and out.weight_version == "7"


def test_a_failed_request_fails_the_rollout(tokenizer: Any) -> None:
    cfg = _cfg()
    gen = FakeGenerator()
    gen.fail_next = [ServiceCallError("POST", "/inference/v1/generate", 400, "prompt too long")]
    with pytest.raises(ServiceCallError, match="prompt too long"):
        _run(_state(cfg, tokenizer, gen, FakeScorer(lambda s: 1)), _source(cfg, tokenizer))


class _PushMidRequest(FakeGenerator):
    """Each reply comes after the engines' version moved on by one (an in-flight weight update)."""

    def __init__(self, version: list[int]) -> None:
        super().__init__()
        self.version = version

    async def generate(self, payload: dict[str, Any], *, session_id: str | None = None) -> dict[str, Any]:
        out = await super().generate(payload, session_id=session_id)
        self.version[0] += 1
        return out


def test_a_sample_carries_the_versions_of_its_first_and_last_tokens(tokenizer: Any) -> None:
    cfg = _cfg()
    version = [4]
    gen = _PushMidRequest(version)
    state = _state(cfg, tokenizer, gen, FakeScorer(lambda s: 1))
    state.weight_version = lambda: version[0]
    out = asyncio.run(generate(state, Sample(tokens=[1, 2]), None))  # vLLM 0.26: no spans
    assert (out.first_weight_version, out.weight_version) == ("4", "5")  # sent at v4, replied at v5
    spans = vllm_reply([31, 32, 33], "stop", False)
    spans["choices"][0]["weight_versions"] = [
        {"version": "2", "start": 0, "end": 1},
        {"version": "3", "start": 1, "end": 3},
    ]
    gen.fail_next = [spans]
    out = asyncio.run(generate(state, Sample(tokens=[1, 2]), None))  # the engine's own spans win
    assert (out.first_weight_version, out.weight_version) == ("2", "3")


def test_an_engine_abort_continues_from_the_partial_output_when_asked(tokenizer: Any) -> None:
    cfg = _cfg(rollout_max_response_len=6)
    gen = FakeGenerator()
    gen.fail_next = [vllm_reply([31, 32], "abort", True), vllm_reply([33, 34], "stop", True)]
    state = _state(cfg, tokenizer, gen, FakeScorer(lambda s: 1), continue_aborted=True)
    out = asyncio.run(generate(state, Sample(tokens=[1, 2]), 0))
    assert out.tokens == [1, 2, 31, 32, 33, 34] and out.rollout_log_probs == [-0.5] * 4
    second = gen.requests[1][0]
    assert second["token_ids"] == [1, 2, 31, 32] and second["sampling_params"]["max_tokens"] == 4
    assert out.status is SampleStatus.COMPLETED and state.counters.engine_aborts_retried == 1
    assert out.first_weight_version == out.weight_version == "3"
