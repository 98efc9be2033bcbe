"""A recording proxy between the trainer and the rollout manager, reading GPU memory around each call.

Every memory transition of a colocated step is a call the trainer makes to the rollout manager
(offload, onload of ``weights`` / ``kv_cache``, the update lock and ``weights-loaded`` around a
push, ``training-completed`` after the trainer has slept). Put between the two — the trainer's
run is started with ``services.rollout_url`` pointing here — the proxy forwards each call
unchanged and records, in order, what was called and the memory just before and just after, so
the seed's order of memory moves is checked at the exact moments it happens, however short the
phase. Nothing else changes: same bodies, same token, same answers.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

SAMPLED = ("/v1/engines/", "/v1/training-completed/", "/v1/rollouts", "/v1/admission/", "/v1/training-ready")
"""Calls with memory read before and after (the rest are only recorded)."""
FORWARDED_HEADERS = ("authorization", "content-type", "accept")


@dataclass
class Call:
    method: str
    path: str
    body: Any
    status: int
    t0: float
    t1: float
    before: int | None
    after: int | None
    detail: dict[str, int] | None = None
    """Memory per process after the call, where the probe can tell (NVML)."""

    @property
    def route(self) -> str:
        """``POST /v1/engines/onload(weights)``-style name, tags included for onloads."""
        name = f"{self.method} {self.path.split('?')[0]}"
        if self.path.startswith("/v1/engines/onload") and isinstance(self.body, dict):
            name += f"({','.join(self.body.get('tags') or ['all'])})"
        return name


class RecordingProxy:
    """``with RecordingProxy(target, probe) as proxy: ... proxy.url ... proxy.calls``."""

    def __init__(
        self,
        target: str,
        probe: Callable[[], int] | None,
        detail: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.target = target.rstrip("/")
        self.probe = probe
        self.detail = detail
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.server.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> RecordingProxy:
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _read_memory(self) -> int | None:
        if self.probe is None:
            return None
        with contextlib.suppress(Exception):
            return self.probe()
        return None

    def _client(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(timeout=None)
        return client

    def forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        sampled = path.startswith(SAMPLED)
        before = self._read_memory() if sampled else None
        t0 = time.monotonic()
        try:
            r = self._client().request(method, self.target + path, headers=headers, content=body)
            status, ctype, content = r.status_code, r.headers.get("content-type", ""), r.content
        except httpx.HTTPError as exc:
            status, ctype = 502, "application/json"
            content = json.dumps({"error": {"message": f"proxy: {type(exc).__name__}: {exc}"}}).encode()
        t1 = time.monotonic()
        after = self._read_memory() if sampled else None
        detail = None
        if sampled and self.detail is not None:
            with contextlib.suppress(Exception):
                detail = self.detail()
        parsed: Any = None
        with contextlib.suppress(ValueError):
            parsed = json.loads(body) if body else None
        with self._lock:
            self.calls.append(Call(method, path, parsed, status, t0, t1, before, after, detail))
        return status, ctype, content

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() in FORWARDED_HEADERS}
                status, ctype, content = proxy.forward(self.command, self.path, headers, body)
                self.send_response(status)
                if ctype:
                    self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PUT = do_DELETE = _any

            def log_message(self, format: str, *args: Any) -> None:
                return None

        return Handler

    def dump(self) -> list[dict[str, Any]]:
        return [{**asdict(c), "route": c.route} for c in self.calls]
