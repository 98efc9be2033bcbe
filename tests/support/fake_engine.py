"""A minimal fake inference engine: a real HTTP server process that speaks vLLM's generate shapes.

For router tests and benchmarks, where the engine's answer does not matter but its timing and
identity do: ``python tests/support/fake_engine.py --port P --engine-id e0 --delay-s 1.5`` (or
``--uds PATH``: on a Unix socket instead, as an engine behind its gate listens).

- ``GET /health`` (200, or 503 after ``POST /fake/config {"healthy": false}``); ``GET /version``
  like vLLM's (the router registers only what answers it)
- ``POST /inference/v1/generate``: vLLM 0.26's response shape (notes/vllm_device.md §4) after
  ``delay_s``, plus ``engine_id`` so a test sees who answered; vLLM's 400 error shape on bad bodies
- ``POST /v1/completions``, ``POST /v1/chat/completions``: small OpenAI shapes, also with ``engine_id``
- vLLM control routes (``/sleep``, ``/pause``, ``/update_weights``, ...): 200, counted, so a test
  proves none arrived through the router
- ``GET /metrics``: ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` like vLLM
- ``GET /fake/stats``: counters; ``POST /fake/config``: change ``delay_s`` / ``healthy`` at runtime
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from typing import Any

from aiohttp import web

CONTROL_ROUTES = (
    "/sleep",
    "/wake_up",
    "/pause",
    "/resume",
    "/update_weights",
    "/collective_rpc",
    "/start_weight_update",
    "/finish_weight_update",
    "/init_weight_transfer_engine",
    "/reset_prefix_cache",
    "/abort_requests",
    "/flush_cache",
)
"""vLLM routes that must never be reachable through the router."""


class FakeEngine:
    """The engine's state: identity, delay, health, counters."""

    def __init__(self, engine_id: str, delay_s: float, max_tokens_cap: int) -> None:
        self.engine_id = engine_id
        self.delay_s = delay_s
        self.max_tokens_cap = max_tokens_cap
        self.healthy = True
        self.generate_total = 0
        self.completed_total = 0
        self.in_flight = 0
        self.control_calls: collections.Counter[str] = collections.Counter()
        self.sessions: collections.Counter[str] = collections.Counter()
        self.started_at = time.time()

    def stats(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "generate_total": self.generate_total,
            "completed_total": self.completed_total,
            "in_flight": self.in_flight,
            "control_calls": dict(self.control_calls),
            "sessions": dict(self.sessions),
            "delay_s": self.delay_s,
            "healthy": self.healthy,
        }


def vllm_error(message: str, param: str, status: int = 400) -> web.Response:
    body = {"error": {"message": message, "type": "Bad Request", "param": param, "code": status}}
    return web.json_response(body, status=status)


def check_generate_body(body: Any) -> tuple[list[int], dict[str, Any]] | web.Response:
    """vLLM's checks on ``{token_ids, sampling_params}``, answered with its 400 shape."""
    if not isinstance(body, dict):
        return vllm_error("body must be a JSON object", "body")
    token_ids = body.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        return vllm_error("token_ids: List should have at least 1 item", "body.token_ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids):
        return vllm_error("token_ids: every item must be a non-negative integer", "body.token_ids")
    params = body.get("sampling_params", {})
    if not isinstance(params, dict):
        return vllm_error("sampling_params must be an object", "body.sampling_params")
    max_tokens = params.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return vllm_error("max_tokens must be at least 1", "body.sampling_params.max_tokens")
    return token_ids, params


def generate_response(engine: FakeEngine, token_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.26's non-streaming generate reply (deterministic tokens, logprob -0.5)."""
    n = min(int(params.get("max_tokens", 16)), engine.max_tokens_cap)
    seed = sum(token_ids) % 997
    out = [(seed + i * 31) % 50000 for i in range(n)]
    logprobs = None
    if params.get("logprobs") is not None:
        content = []
        for t in out:
            entry = {"token": f"token_id:{t}", "logprob": -0.5, "bytes": None}
            content.append({**entry, "top_logprobs": [entry]})
        logprobs = {"content": content}
    finish = "length" if n == params.get("max_tokens", 16) else "stop"
    return {
        "request_id": f"generate-tokens-{engine.engine_id}-{engine.generate_total}",
        "model": "fake",
        "created": int(time.time()),
        "choices": [
            {
                "index": 0,
                "logprobs": logprobs,
                "finish_reason": finish,
                "token_ids": out,
                "routed_experts": None,
            }
        ],
        "usage": {
            "prompt_tokens": len(token_ids),
            "total_tokens": len(token_ids) + n,
            "completion_tokens": n,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "kv_transfer_params": None,
        "engine_id": engine.engine_id,
    }


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except ValueError:
        return vllm_error("body is not valid JSON", "body")


class Handlers:
    """The engine's HTTP routes."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    async def _serve(self) -> None:
        """Count the request in flight for ``delay_s`` (what the metrics and drain tests see)."""
        engine = self.engine
        engine.generate_total += 1
        engine.in_flight += 1
        try:
            if engine.delay_s > 0:
                await asyncio.sleep(engine.delay_s)
        finally:
            engine.in_flight -= 1
        engine.completed_total += 1

    async def generate(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        checked = body if isinstance(body, web.Response) else check_generate_body(body)
        if isinstance(checked, web.Response):
            return checked
        session = request.headers.get("X-Session-ID")
        if session:
            self.engine.sessions[session] += 1
        await self._serve()
        return web.json_response(generate_response(self.engine, *checked))

    async def openai(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        await self._serve()
        kind = "chat.completion" if request.path.endswith("chat/completions") else "text_completion"
        choice = {"index": 0, "finish_reason": "length", "text": " w1"}
        out = {"object": kind, "model": "fake", "choices": [choice], "engine_id": self.engine.engine_id}
        return web.json_response(out)

    async def control(self, request: web.Request) -> web.Response:
        self.engine.control_calls[request.path] += 1
        return web.json_response({"status": "ok", "engine_id": self.engine.engine_id})

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": "0.26.0"})

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.healthy else 503)

    async def metrics(self, _: web.Request) -> web.Response:
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="fake"}} {float(self.engine.in_flight)}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{engine="0",model_name="fake"} 0.0\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response(self.engine.stats())

    async def configure(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "delay_s" in body:
            self.engine.delay_s = float(body["delay_s"])
        if "healthy" in body:
            self.engine.healthy = bool(body["healthy"])
        return web.json_response(self.engine.stats())


def build_app(engine: FakeEngine) -> web.Application:
    h = Handlers(engine)
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_post("/inference/v1/generate", h.generate)
    app.router.add_post("/v1/completions", h.openai)
    app.router.add_post("/v1/chat/completions", h.openai)
    for path in CONTROL_ROUTES:
        app.router.add_post(path, h.control)
    app.router.add_get("/health", h.health)
    app.router.add_get("/version", h.version)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/fake/stats", h.stats)
    app.router.add_post("/fake/config", h.configure)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="fake inference engine for router tests")
    p.add_argument("--host", default="127.0.0.1")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int)
    where.add_argument("--uds", help="listen on this Unix socket instead of a TCP port")
    p.add_argument("--engine-id", required=True)
    p.add_argument("--delay-s", type=float, default=0.0, help="fixed time every generate takes")
    p.add_argument("--max-tokens-cap", type=int, default=64, help="most tokens one reply carries")
    args = p.parse_args(argv)
    engine = FakeEngine(args.engine_id, args.delay_s, args.max_tokens_cap)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    address = {"path": args.uds} if args.uds else {"host": args.host, "port": args.port}
    web.run_app(build_app(engine), **address, print=None, access_log=None, backlog=4096)


if __name__ == "__main__":
    main()
