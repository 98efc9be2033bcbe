"""The data-plane client resends a generate only when no engine produced anything: connection
failures, replies cut off before their end, 502/503/504, and vllm-router's 500 for a request it
could not deliver (an engine killed mid-rollout). An engine's own 500 is an answer and fails at once. It keeps resending for a time
(``router.retry_window_s``), not a number of attempts: long enough for an engine to come back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from vime import procs
from vime.clients.base import ServiceCallError, ServiceUnreachable
from vime.clients.router import RouterDataClient, retryable_generate
from vime.wire.vllm import GENERATE_PATH

DELIVERY_FAILED = (
    "Request failed: error sending request for url (http://127.0.0.1:20426/inference/v1/generate)"
)
ENGINE_ERROR = {"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError"}}


NO_WORKERS = "No available workers (all circuits open or unhealthy)"


@asynccontextmanager
async def router_serving(
    generate: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A stand-in router whose generate route is ``generate``; yields its url."""
    app = web.Application()
    app.router.add_post(GENERATE_PATH, generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = procs.free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def router_answering(
    replies: list[web.Response], no_engine_until: float = 0.0
) -> AsyncIterator[tuple[str, list[int]]]:
    """A stand-in router that gives ``replies`` in turn (503 while ``time.monotonic()`` is before
    ``no_engine_until``), then 200s; yields (url, calls)."""
    calls: list[int] = []

    async def generate(_: web.Request) -> web.Response:
        calls.append(1)
        if time.monotonic() < no_engine_until:
            return web.Response(status=503, text=NO_WORKERS)
        return replies.pop(0) if replies else web.json_response({"choices": [{"token_ids": [1]}]})

    async with router_serving(generate) as url:
        yield url, calls


def test_which_answers_are_resent() -> None:
    assert retryable_generate(502, "") and retryable_generate(503, "") and retryable_generate(504, "")
    assert retryable_generate(500, DELIVERY_FAILED)
    assert not retryable_generate(500, "EngineCore encountered an issue")
    assert not retryable_generate(400, DELIVERY_FAILED)


def test_a_delivery_failure_is_sent_again_and_an_engine_error_is_not() -> None:
    async def main() -> None:
        lost = [web.Response(status=500, text=DELIVERY_FAILED), web.Response(status=503, text="no workers")]
        async with router_answering(lost) as (url, calls), RouterDataClient(url, backoff_s=0.01) as c:
            out = await c.generate([1, 2], {"max_tokens": 1})
        assert out["choices"][0]["token_ids"] == [1] and len(calls) == 3
        failing = [web.json_response(ENGINE_ERROR, status=500)]
        async with router_answering(failing) as (url, calls), RouterDataClient(url, backoff_s=0.01) as c:
            with pytest.raises(ServiceCallError, match="EngineCore encountered an issue"):
                await c.generate([1, 2], {"max_tokens": 1})
        assert len(calls) == 1

    asyncio.run(main())


def test_a_generate_waits_for_an_engine_within_the_retry_window_and_no_longer() -> None:
    """The issue-17 case: every engine gone for a while (503 No available workers); a window longer
    than the outage rides it out, a shorter one gives up naming the setting."""

    async def main() -> None:
        back_at = time.monotonic() + 1.0
        async with (
            router_answering([], no_engine_until=back_at) as (url, calls),
            RouterDataClient(url, retry_window_s=10, backoff_s=0.05, max_backoff_s=0.2) as c,
        ):
            out = await c.generate([1, 2], {"max_tokens": 1})
        assert out["choices"][0]["token_ids"] == [1] and time.monotonic() >= back_at and len(calls) > 3
        async with (
            router_answering([], no_engine_until=time.monotonic() + 60) as (url, calls),
            RouterDataClient(url, retry_window_s=0.3, backoff_s=0.05, max_backoff_s=0.1) as c,
        ):
            with pytest.raises(ServiceUnreachable, match=r"retry_window_s=0.3s.*No available workers"):
                await c.generate([1, 2], {"max_tokens": 1})
        async with (
            router_answering([web.Response(status=503, text=NO_WORKERS)]) as (url, calls),
            RouterDataClient(url, retry_window_s=0) as c,
        ):
            with pytest.raises(ServiceUnreachable):
                await c.generate([1, 2], {"max_tokens": 1})
        assert len(calls) == 1  # a window of 0: never sent again

    asyncio.run(main())


def test_a_reply_cut_off_before_its_end_is_sent_again() -> None:
    """An engine killed while the router relays its reply: the body stops short of its length
    (aiohttp's ClientPayloadError, seen in the fault test of an engine killed mid-rollout). Nothing
    usable came back, so the request goes again; with no retry window it is named unreachable."""

    async def main() -> None:
        calls: list[int] = []

        async def generate(request: web.Request) -> web.StreamResponse:
            calls.append(1)
            if len(calls) > 1:
                return web.json_response({"choices": [{"token_ids": [7]}]})
            reply = web.StreamResponse(status=200)
            reply.content_length = 1000
            reply.content_type = "application/json"
            await reply.prepare(request)
            await reply.write(b'{"choices": [')
            assert request.transport is not None
            request.transport.close()  # the connection ends 987 bytes short
            return reply

        async with router_serving(generate) as url:
            async with RouterDataClient(url, backoff_s=0.01) as c:
                out = await c.generate([1, 2], {"max_tokens": 1})
            assert out["choices"][0]["token_ids"] == [7] and len(calls) == 2
            calls.clear()
            async with RouterDataClient(url, retry_window_s=0) as c:
                with pytest.raises(ServiceUnreachable, match="ClientPayloadError"):
                    await c.generate([1, 2], {"max_tokens": 1})
            assert len(calls) == 1

    asyncio.run(main())
