"""Clients for the router: its control plane (engines) and its data plane (generate).

`RouterClient` registers, lists, drains and removes engines (``services.router_control_port``).
`RouterDataClient` posts generate requests to the public data-plane port (seed steps 20–21). It
uses aiohttp, not httpx: httpx's connection pool costs 14–27 ms of CPU per request at 512–2048
requests in flight (notes/router_redis.md §1.3), aiohttp's stays well under 1 ms.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from typing import Any

from vime.clients.base import RETRYABLE_STATUS, ServiceCallError, ServiceClient, ServiceUnreachable
from vime.wire.router import (
    SESSION_HEADER,
    DataPlaneStatus,
    EngineList,
    EngineRegistration,
    EngineStatus,
    default_engine_id,
)
from vime.wire.vllm import GENERATE_PATH

UPSTREAM_FAILED = "Request failed: "
"""How vllm-router words a 500 when its own request to the engine failed in transport (the engine
died or refused the connection: nothing was generated), unlike an engine's own 500, which it
passes through as the engine wrote it."""


def retryable_generate(status: int, message: str) -> bool:
    """Whether no engine produced anything, so the same request may be sent again."""
    return status in RETRYABLE_STATUS or (status == 500 and message.startswith(UPSTREAM_FAILED))


class RouterClient(ServiceClient):
    """The router's control plane."""

    async def register(
        self, url: str, *, engine_id: str | None = None, gpu_ids: Sequence[int] = ()
    ) -> EngineStatus:
        """Register an engine (idempotent for the same id and url); it serves once healthy."""
        body = EngineRegistration(url=url, id=engine_id, gpu_ids=list(gpu_ids)).model_dump(exclude_none=True)
        out = await self.request("POST", "/v1/engines", json=body, idempotent=True, expect=(200, 201))
        return EngineStatus.model_validate(out)

    async def deregister(self, engine: str) -> bool:
        """Remove an engine by id or by url (its default id); False if it was not registered."""
        engine_id = default_engine_id(engine) if "://" in engine else engine
        response = await self.send("DELETE", f"/v1/engines/{engine_id}", idempotent=True)
        if response.status_code == 404:
            return False
        if response.status_code != 200:
            raise ServiceCallError(
                "DELETE", f"{self.base_url}/v1/engines/{engine_id}", response.status_code, response.text
            )
        return True

    async def engines(self) -> EngineList:
        return EngineList.model_validate(await self.request("GET", "/v1/engines", idempotent=True))

    async def engine(self, engine_id: str) -> EngineStatus:
        """One engine, with its in-flight count read now (health as of the last probe)."""
        return EngineStatus.model_validate(
            await self.request("GET", f"/v1/engines/{engine_id}", idempotent=True)
        )

    async def drain(self, engine_id: str) -> EngineStatus:
        """Stop new requests to the engine; the ones in flight finish."""
        out = await self.request("POST", f"/v1/engines/{engine_id}/drain", idempotent=True)
        return EngineStatus.model_validate(out)

    async def undrain(self, engine_id: str) -> EngineStatus:
        out = await self.request("POST", f"/v1/engines/{engine_id}/undrain", idempotent=True)
        return EngineStatus.model_validate(out)

    async def wait_drained(
        self, engine_id: str, *, timeout_s: float = 600.0, poll_s: float = 0.5
    ) -> EngineStatus:
        """Drain, then wait until the engine reports nothing in flight."""
        await self.drain(engine_id)
        status = await self.engine(engine_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while status.in_flight != 0:
            if status.in_flight is None:
                raise ServiceCallError(
                    "GET",
                    f"{self.base_url}/v1/engines/{engine_id}",
                    200,
                    "the engine does not report vllm:num_requests_running/_waiting in /metrics; "
                    "its in-flight requests cannot be watched",
                )
            if loop.time() > deadline:
                raise TimeoutError(
                    f"engine {engine_id} still has {status.in_flight} requests after {timeout_s}s"
                )
            await asyncio.sleep(poll_s)
            status = await self.engine(engine_id)
        return status

    async def data_plane(self) -> DataPlaneStatus:
        return DataPlaneStatus.model_validate(await self.request("GET", "/v1/data-plane", idempotent=True))


class RouterDataClient:
    """Generate requests through the router's public port, one pooled aiohttp session.

    Connection failures, 502/503/504 and vllm-router's transport 500s are retried with backoff
    (``attempts`` in all): those mean no engine produced anything, so the request is sent again,
    through the router, to another engine. Any other status raises `ServiceCallError` at once.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float | None = 1800.0,
        attempts: int = 8,
        backoff_s: float = 0.25,
        max_backoff_s: float = 4.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._session: Any = None

    def _client(self) -> Any:
        if self._session is None:
            import aiohttp

            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=15.0, happy_eyeballs_delay=None)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, connect=10.0),
                raise_for_status=False,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> RouterDataClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def post(
        self, path: str, payload: Mapping[str, Any], *, session_id: str | None = None
    ) -> dict[str, Any]:
        """POST JSON to a data-plane route and return the JSON object it answers."""
        import aiohttp

        headers = {SESSION_HEADER: session_id} if session_id else None
        url = self.base_url + path
        last = ""
        for attempt in range(self.attempts):
            try:
                async with self._client().post(url, json=dict(payload), headers=headers) as r:
                    if r.status == 200:
                        out = await r.json(content_type=None)
                        if not isinstance(out, dict):
                            raise ServiceCallError("POST", url, 200, f"not a JSON object: {str(out)[:200]}")
                        return out
                    text = await r.text()
                    if not retryable_generate(r.status, _message(text)):
                        raise ServiceCallError("POST", url, r.status, _message(text), body=text)
                    last = f"HTTP {r.status}: {_message(text)}"
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if attempt + 1 < self.attempts:
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                await asyncio.sleep(delay * (1 + 0.25 * random.random()))
        raise ServiceUnreachable(f"POST {url} failed after {self.attempts} attempts: {last}")

    async def generate(
        self,
        token_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        model: str | None = None,
        session_id: str | None = None,
    ) -> dict[str, Any]:
        """``POST /inference/v1/generate`` (seed step 20); the raw reply for `parse_generate_response`."""
        body: dict[str, Any] = {"token_ids": list(token_ids), "sampling_params": dict(sampling_params)}
        if model is not None:
            body["model"] = model
        return await self.post(GENERATE_PATH, body, session_id=session_id)


def _message(text: str) -> str:
    import json

    try:
        body = json.loads(text)
    except ValueError:
        return text[:300]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))[:300]
    return str(err or body)[:300]
