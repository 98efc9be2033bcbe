"""The compact generate route's reply and its launcher, without vLLM (fakes with vLLM 0.26's field names)."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
from vime_rollout.vllm_ext import serve
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


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> types.ModuleType:
    """vLLM's two modules the launcher touches: the API server's ``build_app`` and the CLI's ``main``."""
    api_server = types.ModuleType("vllm.entrypoints.openai.api_server")
    api_server.build_app = lambda *a, **k: calls.append("build_app") or "app"  # type: ignore[attr-defined]
    cli = types.ModuleType("vllm.entrypoints.cli.main")

    def vllm_main() -> None:
        calls.append(f"main:{api_server.build_app()}")  # type: ignore[attr-defined]

    cli.main = vllm_main  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.entrypoints", "vllm.entrypoints.openai", "vllm.entrypoints.cli"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.openai.api_server", api_server)
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.main", cli)
    return api_server


def test_the_launcher_adds_the_route_to_the_app_vllm_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    _fake_vllm(monkeypatch, calls)
    route = types.ModuleType("vime_rollout.vllm_ext.compact_generate")
    route.attach = lambda app: calls.append(f"attach:{app}") or "app+route"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vime_rollout.vllm_ext.compact_generate", route)
    serve.main()
    assert calls == ["build_app", "attach:app", "main:app+route"]


def test_the_launcher_serves_without_the_route_where_it_cannot_be_imported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []
    _fake_vllm(monkeypatch, calls)  # a vLLM without the serving classes the route reuses
    monkeypatch.delitem(sys.modules, "vime_rollout.vllm_ext.compact_generate", raising=False)
    serve.main()
    assert calls == ["build_app", "main:app"]
    assert "no compact generate route" in caplog.text
