"""The engine control calls the rollout manager makes directly (never through the router).

They go through `vime.clients.engine.EngineClient` (vLLM's dev-mode routes, and the reference
engine's copies). Those routes are unauthenticated, which is why engines listen on a private
interface and the router forwards only generate routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from vime.clients.engine import EngineClient
from vime.wire.engine import PauseMode

HEALTH_TIMEOUT_S = 5.0
"""Default bound of a /health probe (``engine.health_check_timeout_s``) and of a /metrics read."""
CONTROL_TIMEOUT_S = 300.0
"""Sleep level 1 copies the weights to CPU; a 1.5B model took 2 s, larger ones take longer."""


class EngineControl(Protocol):
    """The part of `EngineClient` the engine group uses (a stub in unit tests)."""

    base_url: str

    async def health(self) -> bool: ...

    async def sleep(self, level: int = ..., mode: PauseMode = ...) -> None: ...

    async def wake_up(self, tags: Sequence[str] | None = ...) -> None: ...

    async def abort_requests(self, request_ids: Sequence[str] | None = ...) -> int | None: ...

    async def weight_version(self) -> str | None: ...

    async def logprobs_mode(self) -> str | None: ...

    async def serves_compact_generate(self) -> bool: ...

    async def finished_requests(self) -> float | None: ...

    async def aclose(self) -> None: ...


def engine_control(url: str, token: str | None = None) -> EngineControl:
    """The control client of one engine (no retries of control calls: the caller decides); ``token``
    opens the engine's gate (`engines.gate`)."""
    return EngineClient(url, token=token, timeout=CONTROL_TIMEOUT_S, retries=1, max_connections=8)


async def healthy(control: EngineControl, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """True when the engine answers /health with 200 within ``timeout_s``; never raises."""
    try:
        return await asyncio.wait_for(control.health(), timeout_s)
    except Exception:
        return False
