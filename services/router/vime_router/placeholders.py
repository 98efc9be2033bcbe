"""Stand-in workers that let vllm-router start with the power_of_two policy.

vllm-router 0.1.17 refuses to start with power_of_two unless it is given at least two workers
("Power-of-two policy requires at least 2 workers"), although at runtime it serves one or none
(503) without complaint. The control plane starts it with no engines, so for that policy it is
given two of these loopback stand-ins, which answer ``/health`` and nothing else; the first sync
of the worker list removes them, before the route filter opens the public port.
"""

from __future__ import annotations

import asyncio
import contextlib

_HEALTHY = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: 51\r\n"
    b'connection: close\r\n\r\n{"error": {"message": "placeholder, not an engine"}}'
)


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.write(_HEALTHY if head.startswith(b"GET /health ") else _REFUSED)
        await writer.drain()
    writer.close()


class Placeholders:
    """Two loopback servers on the given ports (kept for vllm-router restarts)."""

    def __init__(self, ports: tuple[int, int]) -> None:
        self.ports = ports
        self._servers: list[asyncio.Server] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    async def start(self) -> None:
        if not self._servers:
            self._servers = [await asyncio.start_server(_answer, "127.0.0.1", p) for p in self.ports]

    def stop(self) -> None:
        for server in self._servers:
            server.close()
        self._servers = []
