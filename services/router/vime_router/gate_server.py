"""The route-filter process: ``python -m vime_router.gate_server --port P --upstream-port U ...``.

Started and restarted by the router service (`vime_router.data_plane`). It listens on the public
data-plane port, forwards the allowed routes to vllm-router on a private loopback port, and
answers ``GET /stats`` (forwarded / refused / in-flight counters, JSON) on a second private port
for the control plane. On SIGTERM it stops accepting, lets in-flight requests finish for up to
``--grace-s`` seconds, and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal

from vime.wire.router import PUBLIC_ROUTES
from vime_router.gate import Gate

log = logging.getLogger("vime.router.gate")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="public interface")
    p.add_argument("--port", type=int, required=True, help="public data-plane port")
    p.add_argument("--upstream-host", default="127.0.0.1")
    p.add_argument("--upstream-port", type=int, required=True, help="vllm-router's private port")
    p.add_argument("--stats-port", type=int, required=True, help="private loopback port for GET /stats")
    p.add_argument("--idle-timeout-s", type=float, default=75.0)
    p.add_argument("--max-body-bytes", type=int, default=64 * 1024 * 1024, help="413 above")
    p.add_argument("--grace-s", type=float, default=10.0)
    return p.parse_args(argv)


async def _serve_stats(gate: Gate, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A one-shot HTTP answer with the counters, whatever was asked."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        body = json.dumps(gate.stats.as_dict()).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
    writer.close()


async def run(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    gate = Gate(
        args.upstream_host,
        args.upstream_port,
        PUBLIC_ROUTES,
        idle_timeout_s=args.idle_timeout_s,
        max_body_bytes=args.max_body_bytes,
    )
    server = await loop.create_server(gate.protocol, args.host, args.port, backlog=4096)
    stats = await asyncio.start_server(lambda r, w: _serve_stats(gate, r, w), "127.0.0.1", args.stats_port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("route filter on %s:%d -> %s:%d", args.host, args.port, args.upstream_host, args.upstream_port)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=min(10.0, args.idle_timeout_s))
        gate.close_idle()
    server.close()
    deadline = loop.time() + args.grace_s
    while gate.stats.as_dict()["in_flight"] and loop.time() < deadline:
        await asyncio.sleep(0.05)
    stats.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        import uvloop

        uvloop.run(run(args))
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
