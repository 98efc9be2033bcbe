"""The compact generate route's reply, without vLLM (fakes with vLLM 0.26's field names)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vime_rollout.vllm_ext.compact_reply import compact_reply, sampled_log_probs

from vime.wire.vllm import LOGPROB_SENTINEL, parse_generate_response


@dataclass
class FlatLogprobs:  # vllm.logprobs.FlatLogprobs: each position's entries, the sampled token first
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def append(self, entries: list[tuple[int, float]]) -> None:
        self.start_indices.append(len(self.logprobs))
        for token, logprob in entries:
            self.token_ids.append(token)
            self.logprobs.append(logprob)
        self.end_indices.append(len(self.logprobs))


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: Any
    finish_reason: str | None


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    num_cached_tokens: int | None = None


def test_the_sampled_tokens_log_probs_come_first_in_each_flat_position() -> None:
    flat = FlatLogprobs()
    flat.append([(7, -0.5)])  # logprobs: 0, the sampled token only
    flat.append([(8, -1.25), (3, -0.1)])  # logprobs: k, the sampled token then the top-k
    flat.append([])  # no entry: vLLM's floor
    flat.append([(4, -2.0)])  # another token than the one sampled: the floor too
    assert sampled_log_probs(flat, [7, 8, 9, 5]) == [-0.5, -1.25, LOGPROB_SENTINEL, LOGPROB_SENTINEL]
    dicts = [{7: Logprob(-0.5)}, {3: Logprob(-0.1), 8: Logprob(-1.25)}, None]
    assert sampled_log_probs(dicts, [7, 8, 9]) == [-0.5, -1.25, LOGPROB_SENTINEL]


def test_the_reply_parses_as_vllms_with_the_same_tokens_log_probs_and_usage() -> None:
    flat = FlatLogprobs()
    for token, logprob in ((11, -0.25), (12, float("-inf")), (13, -3.0)):
        flat.append([(token, logprob)])
    final = RequestOutput(
        [CompletionOutput(0, [11, 12, 13], flat, "length"), CompletionOutput(1, [14], None, None)],
        prompt_token_ids=[1, 2, 3, 4],
        num_cached_tokens=2,
    )
    body = json.loads(json.dumps(compact_reply(final, "generate-tokens-x", "m", True), allow_nan=False))
    first, second = parse_generate_response(body, 0), parse_generate_response(body, 1)
    assert first.token_ids == [11, 12, 13] and first.log_probs == [-0.25, LOGPROB_SENTINEL, -3.0]
    assert (first.finish_reason, second.finish_reason) == ("length", "stop")
    assert second.log_probs == [LOGPROB_SENTINEL]  # asked for, none kept: floored, never missing
    assert (first.prompt_tokens, first.completion_tokens, first.cached_tokens) == (4, 4, 2)
    assert body["request_id"] == "generate-tokens-x" and body["model"] == "m"
    bare = compact_reply(final, "r", "m", False)
    assert [c["logprobs"] for c in bare["choices"]] == [None, None]
