"""The data plane: ``POST /inference/v1/generate`` through the router (seed steps 20–21).

One pooled HTTP client for the whole rollout, msgspec for the JSON (thousands of requests per
rollout), and a retry policy that is about engines, not about the request: a refused connection,
a connection cut mid-generation (an engine died), or a 5xx from the router (its retries ran out,
no healthy engine) is retried with backoff — through the router, so on another engine — because
the sample is untouched until a response is parsed. A 4xx is the request's own fault and fails
at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from vime.wire.vllm import GENERATE_PATH

log = logging.getLogger("vime.rollout.transport")

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
SESSION_HEADER = "X-Session-ID"


class GenerateFailed(RuntimeError):
    """A generate request that cannot succeed (4xx) or kept failing through every retry."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass(frozen=True)
class RetryPolicy:
    """How long one sample keeps trying: ``attempts`` tries, backoff doubling up to ``max_backoff_s``."""

    attempts: int = 10
    backoff_s: float = 0.25
    max_backoff_s: float = 5.0

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**attempt) * (1 + 0.25 * random.random())


class GenerateClient:
    """Sends generate requests to one base URL (the router, or an engine in benchmarks)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float | None = 1800.0,
        max_connections: int = 4096,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.retries_done = 0
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def generate(self, payload: dict[str, Any], *, session_id: str | None = None) -> dict[str, Any]:
        """The engine's JSON reply; retries engine failures, raises `GenerateFailed` otherwise."""
        body = msgspec.json.encode(payload)
        headers = {"content-type": "application/json"}
        if session_id is not None:
            headers[SESSION_HEADER] = session_id
        last = ""
        for attempt in range(self.retry.attempts):
            try:
                response = await self._client.post(GENERATE_PATH, content=body, headers=headers)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    return _decode(response)
                last = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code not in RETRYABLE_STATUS:
                    raise GenerateFailed(f"generate rejected: {last}", response.status_code)
            if attempt + 1 < self.retry.attempts:
                self.retries_done += 1
                delay = self.retry.delay(attempt)
                log.warning("generate failed (%s); retry %d in %.2fs", last, attempt + 1, delay)
                await asyncio.sleep(delay)
        raise GenerateFailed(f"generate failed after {self.retry.attempts} attempts: {last}")


def _decode(response: httpx.Response) -> dict[str, Any]:
    try:
        out = msgspec.json.decode(response.content)
    except msgspec.DecodeError as exc:
        raise GenerateFailed(f"generate reply is not JSON: {exc}") from None
    if not isinstance(out, dict):
        raise GenerateFailed(f"generate reply is a {type(out).__name__}, not an object")
    return out
