"""EngineClient against recorded vLLM 0.26 / 0.33 shapes: empty bodies, spans, errors, query encoding."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from vime.clients.base import ServiceCallError
from vime.clients.engine import EngineClient
from vime.wire.engine import EngineVersion, engine_request_id, normalize_wake_tags, shm_update_info

Handler = Callable[[httpx.Request], httpx.Response]

# A 0.26 generate response as the GPU machine returned it (notes/vllm_device.md), trimmed.
V026_GENERATE = {
    "request_id": "generate-tokens-82d84b49e63a5e4b",
    "model": "tiny",
    "created": 1795987494,
    "choices": [
        {
            "index": 0,
            "logprobs": {
                "content": [
                    {"token": "token_id:34", "logprob": 0.0, "bytes": None, "top_logprobs": []},
                    {"token": "token_id:245", "logprob": -1.5, "bytes": None, "top_logprobs": []},
                ]
            },
            "finish_reason": "length",
            "token_ids": [34, 245],
            "routed_experts": None,
        }
    ],
    "usage": {"prompt_tokens": 8, "total_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": None},
    "prompt_logprobs": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
}


def _client(handler: Handler) -> EngineClient:
    return EngineClient("http://engine", transport=httpx.MockTransport(handler), retries=0)


class Recorder:
    """A mock engine that records requests and answers from a route table."""

    def __init__(self, routes: dict[tuple[str, str], httpx.Response]) -> None:
        self.routes = routes
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        return self.routes.get(
            (request.method, request.url.path), httpx.Response(404, json={"detail": "Not Found"})
        )


async def test_generate_parses_026_without_version() -> None:
    rec = Recorder({("POST", "/inference/v1/generate"): httpx.Response(200, json=V026_GENERATE)})
    async with _client(rec) as client:
        result = await client.generate([1, 2, 3], {"max_tokens": 2}, model="tiny", request_id="abc")
    assert result.token_ids == [34, 245] and result.log_probs == [0.0, -1.5]
    assert result.finish_reason == "length" and result.completion_tokens == 2
    assert result.weight_version is None and result.weight_versions is None
    body = json.loads(rec.seen[0].content)
    assert body == {
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 2},
        "model": "tiny",
        "request_id": "abc",
    }


async def test_generate_reads_033_spans_and_n_choices() -> None:
    spans = [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1, "end": 2}]
    second = {**V026_GENERATE["choices"][0], "index": 1, "token_ids": [7, 8], "weight_versions": spans}  # type: ignore[dict-item]
    first = {**V026_GENERATE["choices"][0], "weight_versions": spans[:1]}  # type: ignore[dict-item]
    out = {**V026_GENERATE, "choices": [first, second]}
    async with _client(
        Recorder({("POST", "/inference/v1/generate"): httpx.Response(200, json=out)})
    ) as client:
        results = await client.generate_choices([1], {"n": 2})
    assert [r.weight_version for r in results] == ["1", "2"]
    assert results[1].token_ids == [7, 8] and results[1].weight_versions == spans


@pytest.mark.parametrize("body", [b"", json.dumps({"status": "sleeping", "level": 2}).encode()])
async def test_sleep_and_wake_accept_026_empty_and_033_json_bodies(body: bytes) -> None:
    rec = Recorder(
        {
            ("POST", "/sleep"): httpx.Response(200, content=body),
            ("POST", "/wake_up"): httpx.Response(200, content=body),
        }
    )
    async with _client(rec) as client:
        assert await client.sleep(2, "keep") is None
        assert await client.wake_up(["weights", "kv_cache"]) is None
        assert await client.wake_up() is None
    assert dict(rec.seen[0].url.params) == {"level": "2", "mode": "keep"}
    assert rec.seen[1].url.params.get_list("tags") == ["weights", "kv_cache"]
    assert rec.seen[2].url.query == b""


async def test_pause_flags_and_state_routes() -> None:
    rec = Recorder(
        {
            ("POST", "/pause"): httpx.Response(200, json={"status": "paused"}),
            ("POST", "/resume"): httpx.Response(200, json={"status": "resumed"}),
            ("GET", "/is_paused"): httpx.Response(200, json={"is_paused": True}),
            ("GET", "/is_sleeping"): httpx.Response(200, json={"is_sleeping": False}),
            ("POST", "/reset_prefix_cache"): httpx.Response(200, json={"success": False}),
            ("GET", "/get_world_size"): httpx.Response(200, json={"world_size": 2}),
        }
    )
    async with _client(rec) as client:
        await client.pause("abort", clear_cache=False)
        await client.pause("keep")
        await client.resume()
        assert await client.is_paused() is True
        assert await client.is_sleeping() is False
        assert await client.reset_prefix_cache(reset_running_requests=True, reset_external=True) is False
        assert await client.get_world_size() == 2
    assert dict(rec.seen[0].url.params) == {"mode": "abort", "clear_cache": "false"}
    assert dict(rec.seen[1].url.params) == {"mode": "keep"}
    assert dict(rec.seen[5].url.params) == {"reset_running_requests": "true", "reset_external": "true"}


async def test_weight_update_bodies() -> None:
    ok = httpx.Response(200, json={"message": "ok"})
    rec = Recorder(
        {
            ("POST", "/init_weight_transfer_engine"): ok,
            ("POST", "/start_weight_update"): ok,
            ("POST", "/update_weights"): ok,
            ("POST", "/finish_weight_update"): ok,
        }
    )
    async with _client(rec) as client:
        await client.init_weight_transfer_engine()
        await client.start_weight_update()
        await client.update_weights(shm_update_info("/dev/shm/b0.safetensors"))
        await client.finish_weight_update(2)
        await client.finish_weight_update()
    assert json.loads(rec.seen[0].content) == {"init_info": {}}
    assert json.loads(rec.seen[2].content) == {
        "update_info": {"backend": "shm", "path": "/dev/shm/b0.safetensors"}
    }
    assert json.loads(rec.seen[3].content) == {"weight_version": "2"}
    assert rec.seen[4].content == b""  # 0.26 takes no version: send nothing


async def test_weight_version_is_none_on_026_and_read_on_033() -> None:
    async with _client(Recorder({})) as client:
        assert await client.weight_version() is None
    rec = Recorder({("GET", "/weight_info"): httpx.Response(200, json={"weight_version": "7"})})
    async with _client(rec) as client:
        assert await client.weight_version() == "7"


async def test_abort_counts_and_errors_in_both_shapes() -> None:
    vllm_error = {
        "error": {
            "message": "start_weight_update must be called first",
            "type": "x",
            "param": None,
            "code": 500,
        }
    }
    rec = Recorder(
        {
            ("POST", "/abort_requests"): httpx.Response(200, json={"status": "aborted", "aborted": 3}),
            ("POST", "/update_weights"): httpx.Response(500, json=vllm_error),
            ("POST", "/pause"): httpx.Response(
                400, json={"error": "Invalid pause mode: x"}
            ),  # 0.33's bare string
        }
    )
    async with _client(rec) as client:
        assert await client.abort_requests([engine_request_id("r1")]) == 3
        with pytest.raises(ServiceCallError) as err:
            await client.update_weights({"backend": "shm", "path": "p"})
        assert err.value.status_code == 500 and "start_weight_update" in err.value.message
        with pytest.raises(ServiceCallError) as err:
            await client.pause("x")  # type: ignore[arg-type]
        assert err.value.status_code == 400 and "Invalid pause mode" in err.value.message
    assert json.loads(rec.seen[0].content) == {"request_ids": ["generate-tokens-r1"]}


async def test_health_reports_a_dead_engine() -> None:
    async with _client(Recorder({("GET", "/health"): httpx.Response(503)})) as client:
        assert await client.health() is False
    async with _client(Recorder({("GET", "/health"): httpx.Response(200)})) as client:
        assert await client.health() is True


@pytest.mark.parametrize(
    ("body", "reference", "reports", "rejects_paused"),
    [
        ({"version": "0.26.0"}, False, False, False),
        ({"version": "0.33.0"}, False, True, True),
        ({"version": "0.26.0", "engine": "vime-reference"}, True, True, False),
    ],
)
async def test_version_capabilities(
    body: dict[str, Any], reference: bool, reports: bool, rejects_paused: bool
) -> None:
    async with _client(Recorder({("GET", "/version"): httpx.Response(200, json=body)})) as client:
        info = await client.version()
    assert (info.is_reference, info.reports_weight_version, info.rejects_requests_while_paused) == (
        reference,
        reports,
        rejects_paused,
    )
    with pytest.raises(ValueError):
        EngineVersion.from_body({"no": "version"})


def test_wire_helpers() -> None:
    assert normalize_wake_tags(["kv_cache", "cuda_graph", "kv_cache"]) == ["kv_cache"]  # seed step 11
    assert normalize_wake_tags(None) is None
    assert engine_request_id("abc") == "generate-tokens-abc"
    assert engine_request_id("generate-tokens-abc") == "generate-tokens-abc"


@pytest.mark.parametrize(
    ("status", "body", "serves"),
    [
        (404, {"detail": "Not Found"}, False),  # a plain `vllm serve`
        (200, V026_GENERATE, False),  # vLLM's own reply shape on that path: not the compact one
        (500, {"error": {"message": "boom"}}, False),  # a route that breaks is not used
        (
            200,
            {"choices": [{"index": 0, "token_ids": [3], "logprobs": [-1.0], "finish_reason": "length"}]},
            True,
        ),
    ],
)
async def test_the_compact_route_is_used_only_where_it_answers_in_the_compact_form(
    status: int, body: dict[str, Any], serves: bool
) -> None:
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/vime/v1/generate"
        sent.append(json.loads(request.content))
        return httpx.Response(status, json=body)

    async with _client(handler) as client:
        assert await client.serves_compact_generate() is serves
    assert sent[0]["sampling_params"]["max_tokens"] == 1 and sent[0]["sampling_params"]["logprobs"] == 0
