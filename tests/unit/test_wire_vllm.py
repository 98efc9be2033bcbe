"""vLLM generate wire: sampling-parameter translation (seed step 19), response parsing (steps 24-25)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from vime.config import load_config
from vime.wire.vllm import (
    LOGPROB_SENTINEL,
    GenerateRequest,
    GenerateResponseError,
    build_sampling_params,
    compact_choice,
    logprobs_to_request,
    parse_generate_response,
)


def test_seed_step_19_translation() -> None:
    cfg = load_config()
    sp = build_sampling_params(
        max_new_tokens=cfg.rollout_max_response_len - 0,
        temperature=cfg.rollout_temperature,
        top_p=cfg.rollout_top_p,
        top_k=cfg.rollout_top_k,
        stop=cfg.rollout_stop or None,
        stop_token_ids=cfg.rollout_stop_token_ids or None,
        logprobs=logprobs_to_request(cfg.score_centering_top_k),
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )
    assert sp == {
        "max_tokens": 1024,
        "temperature": 1.0,
        "top_p": 1.0,
        "output_kind": 2,  # FINAL_ONLY: the engine's output once, at the end (the same reply)
        "logprobs": 0,  # the seed's 1 gives the same numbers (tests/contract); 0 skips the top-1 search
        "flat_logprobs": True,
        "top_k": -1,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }


@pytest.mark.parametrize(("top_k", "sent"), [(-1, True), (0, False), (20, True), (None, False)])
def test_top_k_sent_only_when_positive_or_minus_one(top_k: int | None, sent: bool) -> None:
    sp = build_sampling_params(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=top_k)
    assert ("top_k" in sp) is sent


def test_stop_fields_and_logprobs_omitted_when_unused() -> None:
    sp = build_sampling_params(
        max_new_tokens=8, temperature=1.0, top_p=1.0, stop=[], logprobs=None, detokenize=False
    )
    assert "stop" not in sp and "stop_token_ids" not in sp and "logprobs" not in sp
    assert sp["detokenize"] is False
    sp = build_sampling_params(max_new_tokens=8, temperature=1.0, top_p=1.0, stop=["\n"], detokenize=False)
    assert sp["stop"] == ["\n"] and "detokenize" not in sp  # stop strings need server-side text
    assert logprobs_to_request(4) == 5 and logprobs_to_request(None) == 0


def test_generate_request_rejects_empty_tokens_and_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        GenerateRequest(token_ids=[], sampling_params={})
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate({"token_ids": [1], "sampling_params": {}, "bogus": 1})


SEED_RESPONSE = {
    "choices": [
        {
            "token_ids": [101, 202, 151645],
            "logprobs": {
                "content": [
                    {"token_id": 101, "logprob": -0.42, "top_logprobs": []},
                    {"token_id": 202, "logprob": -1.10, "top_logprobs": []},
                    {"token_id": 151645, "logprob": -0.08, "top_logprobs": []},
                ]
            },
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 200, "completion_tokens": 3},
    "weight_version": "1",
}

# Recorded from real vLLM 0.26.0 on the GPU machine (notes/vllm_device.md §4).
VLLM_026_RESPONSE = {
    "request_id": "generate-tokens-82d84b49e63a5e4b",
    "model": "tiny",
    "created": 1795987494,
    "choices": [
        {
            "index": 0,
            "logprobs": {
                "content": [
                    {
                        "token": "token_id:34",
                        "logprob": 0.0,
                        "bytes": None,
                        "top_logprobs": [{"token": "token_id:34", "logprob": 0.0, "bytes": None}],
                    }
                ]
                * 8
            },
            "finish_reason": "length",
            "token_ids": [34, 34, 34, 34, 245, 34, 34, 34],
            "routed_experts": None,
        }
    ],
    "usage": {"prompt_tokens": 8, "total_tokens": 16, "completion_tokens": 8, "prompt_tokens_details": None},
    "prompt_logprobs": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
}


def test_parse_seed_response() -> None:
    r = parse_generate_response(SEED_RESPONSE)
    assert r.token_ids == [101, 202, 151645]
    assert r.log_probs == [-0.42, -1.10, -0.08]
    assert r.finish_reason == "stop"
    assert r.weight_version == "1"
    assert r.meta_info() == {
        "finish_reason": {"type": "stop"},
        "weight_version": "1",
        "prompt_tokens": 200,
        "completion_tokens": 3,
        "cached_tokens": 0,
    }


def test_parse_vllm_026_response_has_no_version() -> None:
    r = parse_generate_response(VLLM_026_RESPONSE)
    assert r.token_ids == [34, 34, 34, 34, 245, 34, 34, 34]
    assert r.log_probs == [0.0] * 8
    assert r.finish_reason == "length"
    assert r.weight_version is None
    assert r.completion_tokens == 8 and r.cached_tokens == 0


def test_parse_vllm_033_spans_and_sentinel() -> None:
    out = {
        "choices": [
            {
                "token_ids": [1, 2, 3],
                "logprobs": {
                    "content": [
                        {"token_id": 1, "logprob": -0.5},
                        {"token_id": 2, "logprob": LOGPROB_SENTINEL},
                        {"token_id": 3, "logprob": -0.1},
                    ]
                },
                "finish_reason": "length",
                "weight_versions": [
                    {"version": "2", "start": 0, "end": 1},
                    {"version": "3", "start": 1, "end": 3},
                ],
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}},
    }
    r = parse_generate_response(out)
    assert r.log_probs == [-0.5, -9999.0, -0.1]  # the sentinel is kept, not dropped
    assert r.weight_version == "3"
    assert r.weight_versions is not None and len(r.weight_versions) == 2
    assert r.cached_tokens == 2


def test_parse_without_logprobs_and_short_content() -> None:
    r = parse_generate_response(
        {"choices": [{"token_ids": [5, 6], "logprobs": None, "finish_reason": "stop"}]}
    )
    assert r.token_ids == [5, 6] and r.log_probs is None
    # A shorter content list truncates to the pairs (zip(strict=False), seed step 25).
    r = parse_generate_response(
        {
            "choices": [
                {
                    "token_ids": [5, 6, 7],
                    "logprobs": {"content": [{"logprob": -1.0}]},
                    "finish_reason": "stop",
                }
            ]
        }
    )
    assert r.token_ids == [5] and r.log_probs == [-1.0]


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"error": {"message": "boom", "code": 400}},
        {"choices": []},
        {"choices": [{"finish_reason": "stop"}]},
    ],
)
def test_malformed_responses_raise(bad: object) -> None:
    with pytest.raises(GenerateResponseError):
        parse_generate_response(bad)  # type: ignore[arg-type]


def test_compact_replies_parse_as_vllms_and_floor_their_log_probs() -> None:
    choice = compact_choice(0, [7, 8, 9], [-0.5, float("-inf"), float("nan")], None)
    assert choice == {
        "index": 0,
        "token_ids": [7, 8, 9],
        "logprobs": [-0.5, -9999.0, -9999.0],
        "finish_reason": "stop",
    }
    out = {"choices": [choice], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
    result = parse_generate_response(out)
    assert result.token_ids == [7, 8, 9] and result.log_probs == [-0.5, LOGPROB_SENTINEL, LOGPROB_SENTINEL]
    assert parse_generate_response({"choices": [compact_choice(0, [7], None, "length")]}).log_probs is None
    with pytest.raises(GenerateResponseError, match="2 log-probs for 3 tokens"):
        parse_generate_response({"choices": [choice | {"logprobs": [-0.5, -0.5]}]})
