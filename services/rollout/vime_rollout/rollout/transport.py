"""The data plane: generate requests through the router (seed steps 20–21), to vime's compact
route where every engine serves it (`EngineGroup.generate_path`), else to vLLM's own.

`vime.clients.router.RouterDataClient` does the work (one pooled aiohttp session; connection
failures and 502/503/504 retried with backoff for ``router.retry_window_s``, through the router,
so on another engine or the restarted one: the sample is untouched until a reply is parsed, so
sending it again loses nothing). This adapter gives it the shape the rollout loop calls.
"""

from __future__ import annotations

from typing import Any

from vime.clients.router import DEFAULT_RETRY_WINDOW_S, RouterDataClient
from vime.wire.vllm import GENERATE_PATH


class RouterGenerator:
    """Generate requests to one base URL: the router (or, in benchmarks, a single engine)."""

    def __init__(
        self,
        base_url: str,
        *,
        path: str = GENERATE_PATH,
        timeout_s: float | None = 1800.0,
        retry_window_s: float = DEFAULT_RETRY_WINDOW_S,
    ) -> None:
        self.path = path
        self.client = RouterDataClient(base_url, timeout_s=timeout_s, retry_window_s=retry_window_s)

    async def generate(self, payload: dict[str, Any], *, session_id: str | None = None) -> dict[str, Any]:
        return await self.client.post(self.path, payload, session_id=session_id)

    async def aclose(self) -> None:
        await self.client.aclose()
