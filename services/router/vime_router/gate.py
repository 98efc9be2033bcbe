"""The route filter in front of vllm-router: only the generate routes get through.

vllm-router 0.1.17 forwards *any* JSON POST path to an engine through its fallback proxy, so
``/sleep``, ``/pause`` or ``/update_weights`` (which unpickles what it is sent) would reach the
GPUs through the router's port. This filter owns the public port and passes a request on only
when its method and exact raw path are in `vime.wire.router.PUBLIC_ROUTES`; everything else is
answered here (404/405/400) and never reaches vllm-router.

It is built for speed on the data plane: asyncio protocols (uvloop when present), llhttp through
httptools to parse each request head (C; a few Python callbacks per request), the head re-written
from what was parsed (so vllm-router sees exactly what was checked: no smuggling through
ambiguous framing), bodies and responses passed through as bytes. Each client connection gets one
upstream connection; responses are only counted (llhttp again) so that a refusal is written after
the responses the client is still owed, never in the middle of one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import cast

import httptools

MAX_HEAD_BYTES = 64 * 1024
"""Largest request line + headers accepted (431 above)."""

_DROP_HEADERS = frozenset({b"expect", b"upgrade", b"proxy-connection", b"keep-alive", b"te", b"trailer"})
_REASONS = {
    400: b"Bad Request",
    404: b"Not Found",
    405: b"Method Not Allowed",
    413: b"Payload Too Large",
    431: b"Request Header Fields Too Large",
    502: b"Bad Gateway",
}


def error_response(status: int, message: str, extra_headers: bytes = b"") -> bytes:
    """A complete HTTP/1.1 error response in vime's error shape; it always closes the connection."""
    body = json.dumps({"error": {"message": message}}).encode()
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n%s\r\n" % (status, _REASONS.get(status, b"Error"), len(body), extra_headers)
    ) + body


class GateStats:
    """Counters the control plane reads (``GET /stats`` on the filter's private stats port)."""

    def __init__(self) -> None:
        self.forwarded = 0
        self.refused = 0
        self.connections: set[ClientConnection] = set()

    def as_dict(self) -> dict[str, int]:
        return {
            "forwarded": self.forwarded,
            "refused": self.refused,
            "connections": len(self.connections),
            "in_flight": sum(c.outstanding for c in self.connections),
        }


class Gate:
    """The filter's configuration and shared state; `protocol()` builds one connection."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        routes: Mapping[str, frozenset[str]],
        *,
        idle_timeout_s: float = 75.0,
        max_body_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.max_body_bytes = max_body_bytes
        self.routes = {p.encode(): frozenset(m.encode() for m in ms) for p, ms in routes.items()}
        self.idle_timeout_s = idle_timeout_s
        self.stats = GateStats()

    def protocol(self) -> ClientConnection:
        return ClientConnection(self)

    def close_idle(self) -> int:
        """Close keep-alive connections idle longer than the timeout (slow-loris guard)."""
        cutoff = time.monotonic() - self.idle_timeout_s
        idle = [c for c in self.stats.connections if c.outstanding == 0 and c.last_active < cutoff]
        for conn in idle:
            conn.close()
        return len(idle)


class ClientConnection(asyncio.Protocol):
    """One client connection: parse requests, forward the allowed ones, refuse the rest."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.upstream: UpstreamConnection | None = None
        self.connecting: list[bytes] | None = None
        self.outstanding = 0
        self.response_started = False
        self.refusal: bytes | None = None
        self.last_active = time.monotonic()
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._forwarding = False
        self._chunked = False
        self._keep_alive = True
        self._body_bytes = 0
        self._out: list[bytes] = []
        self._new_request = False

    # --- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.gate.stats.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self.refusal is not None:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._forwarding:  # broken in the middle of a forwarded body: abandon that request
                self._drop_upstream()
            upgrade = isinstance(exc, httptools.HttpParserUpgrade)
            self.refuse(
                400, "protocol upgrades are not served here" if upgrade else f"malformed HTTP request: {exc}"
            )
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.stats.connections.discard(self)
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()
        self.upstream = None

    def pause_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    # --- httptools callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._forwarding = False
        self._chunked = False
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.refusal is not None:
            return
        if self._head_bytes > MAX_HEAD_BYTES:
            self.refuse(431, f"request head larger than {MAX_HEAD_BYTES} bytes")
            return
        method = self.parser.get_method()
        path = self._url.partition(b"?")[0]
        methods = self.gate.routes.get(path)
        if methods is None:
            self.refuse(404, f"{path.decode('latin-1')[:200]} is not served by the router")
            return
        if method not in methods:
            allow = b"allow: " + b", ".join(sorted(methods)) + b"\r\n"
            self.refuse(405, f"{method.decode('latin-1')} is not allowed on {path.decode()}", allow)
            return
        if self._declared_length() > self.gate.max_body_bytes:
            # Answered here: vllm-router would answer 413 too, but it hangs up while the body is
            # still arriving, and the reset can destroy its answer before it is read.
            self.refuse(413, f"request body larger than {self.gate.max_body_bytes} bytes")
            return
        self._forwarding = True
        self._keep_alive = self.parser.should_keep_alive()
        self.outstanding += 1
        self.gate.stats.forwarded += 1
        self.send_upstream(self._head(method), head=True)

    def on_body(self, body: bytes) -> None:
        if not self._forwarding:
            return
        self._body_bytes += len(body)
        if self._body_bytes > self.gate.max_body_bytes:  # a chunked body that grew too large
            self._drop_upstream()
            self.refuse(413, f"request body larger than {self.gate.max_body_bytes} bytes")
            return
        self.send_upstream(b"%x\r\n%s\r\n" % (len(body), body) if self._chunked else body)

    def on_message_complete(self) -> None:
        if self._forwarding and self._chunked:
            self.send_upstream(b"0\r\n\r\n")
        self._forwarding = False

    # --- forwarding ----------------------------------------------------------------------------
    def _declared_length(self) -> int:
        for name, value in self._headers:
            if name.lower() == b"content-length":
                return int(value)  # llhttp has checked it is one decimal number
        return 0

    def _drop_upstream(self) -> None:
        """Abandon the upstream connection and everything owed on it."""
        upstream, self.upstream = self.upstream, None
        self.connecting = None
        self._out.clear()
        self._new_request = False
        self.outstanding = 0
        self._forwarding = False
        if upstream is not None and upstream.transport is not None:
            upstream.transport.close()

    def _head(self, method: bytes) -> bytes:
        """The request head rebuilt from what llhttp parsed (hop-by-hop extras dropped)."""
        lines = [b"%s %s HTTP/%s\r\n" % (method, self._url, self.parser.get_http_version().encode())]
        for name, value in self._headers:
            lower = name.lower()
            if lower == b"transfer-encoding":
                self._chunked = True
                continue
            if lower == b"expect":
                if value.lower() == b"100-continue" and self.outstanding == 1 and self.transport:
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                continue
            if lower in _DROP_HEADERS:
                continue
            lines.append(b"%s: %s\r\n" % (name, value))
        if self._chunked:
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def send_upstream(self, data: bytes, head: bool = False) -> None:
        """Queue bytes for vllm-router; `_flush` sends what one read produced in one write."""
        self._out.append(data)
        self._new_request = self._new_request or head

    def _flush(self) -> None:
        if not self._out:
            return
        data = b"".join(self._out)
        self._out.clear()
        new_request, self._new_request = self._new_request, False
        upstream = self.upstream
        if upstream is not None and upstream.transport is not None:
            upstream.transport.write(data)
        elif self.connecting is not None:
            self.connecting.append(data)
        elif new_request:  # first request, or the upstream side had gone idle and closed
            self.connecting = [data]
            asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(lambda: UpstreamConnection(self), *self.gate.upstream)
        except OSError as exc:
            self.connecting = None
            self.outstanding = 0
            self.refuse(502, f"the router's data plane is not reachable: {exc}")
            return
        if self.connecting is None or self.transport is None or self.transport.is_closing():
            if upstream.transport is not None:  # the client left, or the request was dropped, meanwhile
                upstream.transport.close()
            return
        self.upstream = upstream
        pending, self.connecting = self.connecting or [], None
        assert upstream.transport is not None
        upstream.transport.write(b"".join(pending))

    def response_done(self) -> None:
        self.outstanding -= 1
        self.response_started = False
        self.last_active = time.monotonic()
        if self.refusal is not None and self.outstanding <= 0:
            self._flush_refusal()

    def upstream_lost(self, upstream: UpstreamConnection) -> None:
        """vllm-router closed its side: owe nothing more, or tell the client what happened."""
        if self.upstream is not upstream:
            return  # one this connection had already dropped
        self.upstream = None
        if self.outstanding <= 0 and not self._forwarding:
            if not self._keep_alive:
                self.close()  # the client asked to close after its last request
            return  # an idle keep-alive connection; reconnect on the next request
        if self.outstanding <= 0:
            self.close()  # it answered early and hung up while the body was still coming
            return
        if not self.response_started:
            self.outstanding = 0
            self.refusal = None
            self.refuse(502, "the router's data plane closed the connection before answering")
        else:
            self.close()

    # --- refusals -----------------------------------------------------------------------------
    def refuse(self, status: int, message: str, extra_headers: bytes = b"") -> None:
        """Answer this request here, after any responses still owed, then close the connection."""
        if self.refusal is not None:
            return
        self.gate.stats.refused += 1
        self.refusal = error_response(status, message, extra_headers)
        self._forwarding = False
        if self.transport is not None:
            self.transport.pause_reading()
        if self.outstanding <= 0:
            self._flush_refusal()

    def _flush_refusal(self) -> None:
        if self.transport is not None and not self.transport.is_closing() and self.refusal is not None:
            self.transport.write(self.refusal)
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()


class UpstreamConnection(asyncio.Protocol):
    """The connection to vllm-router that serves one client connection; responses pass through."""

    def __init__(self, client: ClientConnection) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        client = self.client.transport
        if client is None or client.is_closing():
            return
        client.write(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.client.close()

    def on_message_begin(self) -> None:
        self.client.response_started = True

    def on_message_complete(self) -> None:
        self.client.response_done()

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.upstream_lost(self)

    def pause_writing(self) -> None:
        if self.client.transport is not None:
            self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.client.transport is not None and self.client.refusal is None:
            self.client.transport.resume_reading()
