"""uvicorn for the reference engine, with a shutdown that does not wait for a resume that never comes.

Requests held by a pause or a sleep would keep uvicorn's graceful shutdown waiting. On SIGTERM /
SIGINT this server first aborts everything in flight or held — each gets its normal response with
``finish_reason="abort"`` — and then lets uvicorn shut down as usual.
"""

from __future__ import annotations

import asyncio
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from vime.service import server_config


class AbortingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._app: FastAPI = config.app
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        core = getattr(self._app.state, "core", None)
        if core is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(core.abort(None)))
        super().handle_exit(sig, frame)


def run(app: FastAPI, host: str, port: int, log_level: str, uds: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT (on the Unix socket ``uds`` when given, as vLLM's ``--uds``)."""
    server = AbortingServer(server_config(app, host, port, log_level, uds))
    server.run()
