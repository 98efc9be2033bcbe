"""The route filter in front of vllm-router (Caddy with the configuration `vime_router.route_filter`
writes), as a process on loopback against a recording upstream.

What must hold: only PUBLIC_ROUTES reach the upstream, and with exactly the listed path (so
encodings, case and dot-segments do not sneak a control route through), refusals come after owed
responses, ambiguous framing never reaches the upstream, and upstream failures become clear 502s.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from vime_router.route_filter import filter_counters, write_config

from tests.support.fake_engine import CONTROL_ROUTES
from vime import procs
from vime.caddy import caddy_binary
from vime.retry import poll_until


@dataclass
class Upstream:
    port: int
    seen: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    """A recording stand-in for vllm-router: echoes what it received."""
    up = Upstream(procs.free_port())

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        record = {
            "method": request.method,
            "path": request.raw_path,
            "headers": {k.lower(): v for k, v in request.headers.items()},
        }
        up.seen.append({**record, "body": body})
        if request.headers.get("x-stream"):  # an SSE stream, chunked, written in pieces
            stream = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await stream.prepare(request)
            for i in range(3):
                await stream.write(b'data: {"token_ids": [%d]}\n\n' % i)
                await asyncio.sleep(0.02)
            await stream.write(b"data: [DONE]\n\n")
            await stream.write_eof()
            return stream
        headers = {"Connection": "close"} if request.headers.get("x-close") else None
        return web.json_response({**record, "body": body.decode()}, headers=headers)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", up.port).start()
    yield up
    await runner.cleanup()


@dataclass
class Filter:
    port: int
    stats_port: int

    async def counters(self) -> dict[str, int]:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{self.stats_port}/metrics") as r:
            return filter_counters(await r.read())


@asynccontextmanager
async def route_filter(
    upstream_port: int, tmp_path: Path, max_body_bytes: int = 64 << 20
) -> AsyncIterator[Filter]:
    f = Filter(procs.free_port(), procs.free_port())
    config = write_config(
        tmp_path / "caddy.json",
        host="127.0.0.1",
        port=f.port,
        upstream_port=upstream_port,
        stats_port=f.stats_port,
        max_body_bytes=max_body_bytes,
        state_dir=tmp_path,
    )
    child = procs.start(
        "caddy", [caddy_binary(), "run", "--config", str(config)], log_path=tmp_path / "caddy.log"
    )
    try:
        both = lambda: _both(f.port, f.stats_port)  # noqa: E731 - Caddy opens its servers one by one
        await poll_until(both, timeout_s=30, interval_s=0.05, what="caddy up")
        yield f
    finally:
        child.stop()


async def _both(*ports: int) -> bool:
    return all([await _answers(p) for p in ports])


async def _answers(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


@pytest.fixture
async def gate(upstream: Upstream, tmp_path: Path) -> AsyncIterator[tuple[Filter, int]]:
    async with route_filter(upstream.port, tmp_path) as f:
        yield f, f.port


async def exchange(port: int, raw: bytes, read_s: float = 2.0) -> bytes:
    """Send raw bytes, read until the gate closes (or ``read_s`` passes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    chunks = []
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), read_s):
            chunks.append(chunk)
    except TimeoutError:
        pass
    writer.close()
    return b"".join(chunks)


def post(path: str, body: bytes = b'{"token_ids":[1],"sampling_params":{}}', extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


async def test_generate_is_forwarded_with_headers_and_body(
    gate: tuple[Filter, int], upstream: Upstream
) -> None:
    g, port = gate
    body = {"token_ids": [151644, 872, 198], "sampling_params": {"max_tokens": 1024, "top_k": -1}}
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://127.0.0.1:{port}/inference/v1/generate", json=body, headers={"X-Session-ID": "abc"}
        ) as r,
    ):
        assert r.status == 200
        echoed = await r.json()
    assert echoed["path"] == "/inference/v1/generate"
    assert json.loads(echoed["body"]) == body
    assert echoed["headers"]["x-session-id"] == "abc"
    await exchange(port, post("/sleep"))
    assert await g.counters() == {"forwarded": 1, "refused": 1, "in_flight": 0}


@pytest.mark.parametrize(
    "path",
    [
        *CONTROL_ROUTES,
        "/sl%65ep",
        "//sleep",
        "/inference/v1/generate/../../sleep",
        "/inference/v1/generate/",
        "/inference/v1/generate%2F..%2F..%2Fsleep",
        "/inference/v1/generate;/../sleep",
        "http://127.0.0.1/sleep",
        "/sleep?next=/inference/v1/generate",
        "/flush_cache",
        "/workers",
        "/add_worker?url=http://evil:1",
    ],
)
async def test_everything_else_is_refused_before_the_upstream(
    gate: tuple[Filter, int], upstream: Upstream, path: str
) -> None:
    _, port = gate
    raw = await exchange(port, post(path, b"{}"))
    assert raw.startswith(b"HTTP/1.1 404 "), raw[:80]
    assert b"is not served by the router" in raw
    assert upstream.seen == []


@pytest.mark.parametrize(
    "path",
    [
        "/INFERENCE/v1/generate",
        "//inference/v1/generate",
        "/./inference/v1/generate",
        "/inference/v1/generat%65",
    ],
)
async def test_spellings_of_a_public_route_reach_the_upstream_as_that_route(
    gate: tuple[Filter, int], upstream: Upstream, path: str
) -> None:
    """Caddy matches paths case-insensitively and after cleaning; what it forwards is the listed path."""
    _, port = gate
    raw = await exchange(port, post(path, extra="connection: close\r\n"))
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:80]
    assert [s["path"] for s in upstream.seen] == ["/inference/v1/generate"]


async def test_wrong_method_on_a_public_path_is_405_with_allow(
    gate: tuple[Filter, int], upstream: Upstream
) -> None:
    _, port = gate
    raw = await exchange(port, b"GET /inference/v1/generate HTTP/1.1\r\nhost: r\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 405 ")
    assert b"allow: post" in raw.lower()
    assert upstream.seen == []


async def test_refusal_waits_for_the_pipelined_response_before_it(
    gate: tuple[Filter, int], upstream: Upstream
) -> None:
    _, port = gate
    raw = await exchange(
        port, post("/inference/v1/generate") + post("/sleep", b"{}") + post("/v1/completions")
    )
    first, _, rest = raw.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200 ")
    assert rest.count(b"HTTP/1.1 ") == 1 and b"HTTP/1.1 404 " in rest  # the request after it is never served
    assert [s["path"] for s in upstream.seen] == ["/inference/v1/generate"]


async def test_chunked_request_bodies_are_reframed_intact(
    gate: tuple[Filter, int], upstream: Upstream
) -> None:
    _, port = gate
    payload = b'{"token_ids":[1,2,3],"sampling_params":{"max_tokens":4}}'
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (payload[:10], payload[10:]))
    raw = (
        b"POST /inference/v1/generate HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n" + chunks + b"0\r\n\r\n"
    )
    out = await exchange(port, raw)
    assert out.startswith(b"HTTP/1.1 200 ")
    assert upstream.seen[0]["body"] == payload


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"POST /inference/v1/generate HTTP/1.1\r\nhost r\r\n\r\n", b"400"),
        (b"NOT-HTTP\r\n\r\n", b""),  # not HTTP: no answer, the connection is dropped after 10 s
        (
            b"POST /inference/v1/generate HTTP/1.1\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
            b"400",
        ),
        (
            b"POST /inference/v1/generate HTTP/1.1\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n"
            b"0\r\n\r\n",
            b"400",
        ),
        (b"POST /inference/v1/generate HTTP/1.1\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", b"431"),
        (  # broken while its body was being forwarded: answered at once, not left hanging
            b"POST /inference/v1/generate HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n4\r\nabcd\r\nzz\r\n",
            b"400",
        ),
    ],
)
async def test_malformed_or_ambiguous_requests_are_refused(
    gate: tuple[Filter, int], upstream: Upstream, raw: bytes, status: bytes
) -> None:
    _, port = gate
    out = await exchange(port, raw)
    assert out.startswith(b"HTTP/1.1 " + status) if status else out == b"", out[:80]
    assert upstream.seen == []


async def test_keep_alive_connection_serves_several_requests_and_reconnects_upstream(
    gate: tuple[Filter, int], upstream: Upstream
) -> None:
    _, port = gate
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for i in range(3):
        # the second response closes the upstream connection; the third request must still work
        writer.write(post("/inference/v1/generate", extra="x-close: 1\r\n" if i == 1 else ""))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(
            next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
        )
        await reader.readexactly(length)
    writer.close()
    assert len(upstream.seen) == 3


async def test_expect_100_continue_is_answered_by_the_filter(
    gate: tuple[Filter, int], upstream: Upstream
) -> None:
    _, port = gate
    out = await exchange(
        port, post("/inference/v1/generate", extra="expect: 100-continue\r\nconnection: close\r\n")
    )
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n")
    assert b"HTTP/1.1 200 " in out and len(upstream.seen) == 1


async def test_unreachable_upstream_is_a_502(tmp_path: Path) -> None:
    async with route_filter(procs.free_port(), tmp_path) as f:
        out = await exchange(f.port, post("/inference/v1/generate"))
        assert out.startswith(b"HTTP/1.1 502 ")
        assert b"did not answer" in out
        assert (await f.counters())["in_flight"] == 0


async def test_bodies_over_the_limit_are_413_declared_or_chunked(upstream: Upstream, tmp_path: Path) -> None:
    async with route_filter(upstream.port, tmp_path, max_body_bytes=1024) as f:
        port = f.port
        declared = await exchange(port, post("/inference/v1/generate", b"[" + b"1," * 1000 + b"1]"))
        assert declared.startswith(b"HTTP/1.1 413 ")
        assert upstream.seen == []  # refused before anything was forwarded
        chunk = b"x" * 600
        chunked = (
            b"POST /inference/v1/generate HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2
            + b"0\r\n\r\n"
        )
        grown = await exchange(port, chunked)
        assert grown.startswith(b"HTTP/1.1 413 ")
        small = await exchange(port, post("/inference/v1/generate", extra="connection: close\r\n"))
        assert small.startswith(b"HTTP/1.1 200 ")
    assert all(s["body"] != chunk * 2 for s in upstream.seen)


async def test_streamed_responses_pass_through_and_are_counted(
    gate: tuple[Filter, int], upstream: Upstream
) -> None:
    _, port = gate
    raw = await exchange(
        port, post("/inference/v1/generate", extra="x-stream: 1\r\n") + post("/pause", b"{}")
    )
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"chunked" in head.lower()
    stream, _, refusal = rest.partition(b"0\r\n\r\n")  # the 404 comes only after the stream's last chunk
    assert stream.count(b"data: ") == 4 and b"[DONE]" in stream
    assert refusal.startswith(b"HTTP/1.1 404 ")
