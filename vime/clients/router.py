"""Clients for the router: its control plane (engines) and its data plane (generate).

`RouterClient` registers, lists, drains and removes engines (``services.router_control_port``).
`RouterDataClient` posts generate requests to the public data-plane port (seed steps 20–21). It
uses aiohttp, not httpx: httpx's connection pool costs 14–27 ms of CPU per request at 512–2048
requests in flight (notes/router_redis.md §1.3), aiohttp's stays well under 1 ms. Both retry with
`vime.retry.RetryPolicy`; the data plane's budget is a time (``router.retry_window_s``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vime.clients.base import (
    RETRYABLE_STATUS,
    GatewayStatus,
    ServiceCallError,
    ServiceClient,
    ServiceUnreachable,
    error_message,
)
from vime.retry import RetryPolicy, poll_until
from vime.wire.router import (
    SESSION_HEADER,
    DataPlaneStatus,
    EngineList,
    EngineRegistration,
    RegisteredEngine,
    default_engine_id,
)
from vime.wire.vllm import GENERATE_PATH

DEFAULT_RETRY_WINDOW_S = 300.0
"""`RouterDataClient`'s default budget (``router.retry_window_s``): an engine restart or a router
restart on a GPU host fits in it."""

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
    ) -> RegisteredEngine:
        """Register an engine (idempotent for the same id and url); it serves at once (422 when it
        does not answer /health)."""
        body = EngineRegistration(url=url, id=engine_id, gpu_ids=list(gpu_ids)).model_dump(exclude_none=True)
        out = await self.request("POST", "/v1/engines", json=body, idempotent=True, expect=(200, 201))
        return RegisteredEngine.model_validate(out)

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

    async def registered_urls(self) -> set[str]:
        """The URLs of every engine the router holds (drained ones included)."""
        return {e.url for e in (await self.engines()).engines}

    async def engine(self, engine_id: str) -> RegisteredEngine:
        """One engine, with its in-flight count read now."""
        return RegisteredEngine.model_validate(
            await self.request("GET", f"/v1/engines/{engine_id}", idempotent=True)
        )

    async def drain(self, engine_id: str) -> RegisteredEngine:
        """Stop new requests to the engine; the ones in flight finish."""
        out = await self.request("POST", f"/v1/engines/{engine_id}/drain", idempotent=True)
        return RegisteredEngine.model_validate(out)

    async def undrain(self, engine_id: str) -> RegisteredEngine:
        out = await self.request("POST", f"/v1/engines/{engine_id}/undrain", idempotent=True)
        return RegisteredEngine.model_validate(out)

    async def wait_drained(
        self, engine_id: str, *, timeout_s: float = 600.0, poll_s: float = 0.5
    ) -> RegisteredEngine:
        """Drain, then wait until the engine reports nothing in flight."""
        await self.drain(engine_id)

        async def idle() -> RegisteredEngine | None:
            status = await self.engine(engine_id)
            if status.in_flight is None:
                raise ServiceCallError(
                    "GET",
                    f"{self.base_url}/v1/engines/{engine_id}",
                    200,
                    "the engine does not report vllm:num_requests_running/_waiting in /metrics; "
                    "its in-flight requests cannot be watched",
                )
            return status if status.in_flight == 0 else None

        return await poll_until(
            idle, timeout_s=timeout_s, interval_s=poll_s, what=f"engine {engine_id} with nothing in flight"
        )

    async def data_plane(self) -> DataPlaneStatus:
        return DataPlaneStatus.model_validate(await self.request("GET", "/v1/data-plane", idempotent=True))


class RouterDataClient:
    """Generate requests through the router's public port, one pooled aiohttp session.

    A request no engine produced anything for (a connection failure, a reply cut off before its
    end — the engine died while the router relayed it —, 502/503/504, vllm-router's transport 500)
    is sent again, through the router, with backoff for up to ``retry_window_s``
    seconds: long enough for a dead engine to be taken out and restarted, or the router to come
    back (0: never again). Any other status raises `ServiceCallError` at once.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float | None = 1800.0,
        retry_window_s: float = DEFAULT_RETRY_WINDOW_S,
        backoff_s: float = 0.25,
        max_backoff_s: float = 4.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry_window_s = retry_window_s
        self.retry = RetryPolicy(
            attempts=None, budget_s=retry_window_s, backoff_s=backoff_s, max_backoff_s=max_backoff_s
        )
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
        lost = (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, GatewayStatus)
        try:
            async for attempt in self.retry.retrying(lambda exc: isinstance(exc, lost)):
                with attempt:
                    return await self._post_once(url, dict(payload), headers)
        except lost as exc:
            raise ServiceUnreachable(
                f"POST {url}: no engine answered within router.retry_window_s={self.retry_window_s:g}s: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        raise AssertionError("unreachable: the retry loop returns or raises")

    async def _post_once(
        self, url: str, payload: dict[str, Any], headers: dict[str, str] | None
    ) -> dict[str, Any]:
        async with self._client().post(url, json=payload, headers=headers) as r:
            if r.status == 200:
                out = await r.json(content_type=None)
                if not isinstance(out, dict):
                    raise ServiceCallError("POST", url, 200, f"not a JSON object: {str(out)[:200]}")
                return out
            text = await r.text()
            message = error_message(text)
            if retryable_generate(r.status, message):
                raise GatewayStatus(r.status, message)
            raise ServiceCallError("POST", url, r.status, message, body=text)

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
