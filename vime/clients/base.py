"""The async HTTP client every typed service client builds on.

One pooled `httpx.AsyncClient` per client (connection reuse), the bearer token on every call,
retries with exponential backoff on connection errors (never on an answered request unless the
caller says it is idempotent and the status is retryable), and a clear error after the last try.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable
from typing import Any, TypedDict, Unpack

import httpx

log = logging.getLogger("vime.clients")

RETRYABLE_STATUS = frozenset({502, 503, 504})
"""Gateway answers meaning no upstream produced a reply (the router's data plane too: an engine
died before its ejection), so an idempotent request may be sent again."""


class ServiceUnreachable(ConnectionError):
    """No answer from a service after all retries."""


class ServiceCallError(RuntimeError):
    """A service answered with an error status."""

    def __init__(self, method: str, url: str, status_code: int, message: str, body: Any = None) -> None:
        super().__init__(f"{method} {url} -> {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.body = body


def error_message(response: httpx.Response) -> str:
    """The message of a vime / vLLM / FastAPI error body, or the raw text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return str(body)[:500]


class SendOptions(TypedDict, total=False):
    """What `ServiceClient.request` and `ServiceClient.send` take besides method and path."""

    json: Any
    params: Any
    headers: dict[str, str] | None
    timeout: float | object | None
    """Seconds for this call; None waits forever; left out (or ``...``) uses the client's timeout."""
    idempotent: bool
    """Safe to resend after a 502/503/504 answer (connection failures are always retried)."""
    retries: int | None
    """Retries for this call; None (or left out) uses the client's."""


class ServiceClient:
    """Base for typed clients: ``await self.request("POST", "/v1/x", json=...)`` returns parsed JSON."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float | None = 60.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_connections: int = 1024,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout or 10.0, 10.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def __aenter__(self) -> ServiceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def request(
        self, method: str, path: str, *, expect: Iterable[int] = (200,), **options: Unpack[SendOptions]
    ) -> Any:
        """Send a request; retry connection failures; return the JSON body (None when empty)."""
        response = await self.send(method, path, **options)
        if response.status_code not in set(expect):
            raise ServiceCallError(
                method,
                f"{self.base_url}{path}",
                response.status_code,
                error_message(response),
                body=_json_or_text(response),
            )
        if not response.content:
            return None
        return _json_or_text(response)

    async def send(self, method: str, path: str, **options: Unpack[SendOptions]) -> httpx.Response:
        """Like `request` but returns the raw response whatever its status."""
        retries = options.get("retries")
        attempts = (self.retries if retries is None else retries) + 1
        timeout = options.get("timeout", ...)
        extra: dict[str, Any] = {} if timeout is ... else {"timeout": timeout}
        idempotent = options.get("idempotent", False)
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                response = await self._client.request(
                    method,
                    path,
                    json=options.get("json"),
                    params=options.get("params"),
                    headers=options.get("headers"),
                    **extra,
                )
            except (
                httpx.ConnectError,
                httpx.RemoteProtocolError,
                httpx.ConnectTimeout,
                httpx.ReadError,
            ) as exc:
                last = exc
            else:
                if not (idempotent and response.status_code in RETRYABLE_STATUS and attempt + 1 < attempts):
                    return response
                last = ServiceCallError(method, path, response.status_code, error_message(response))
            if attempt + 1 < attempts:
                delay = self.backoff_s * (2**attempt) * (1 + random.random() * 0.25)
                log.debug("retrying %s %s in %.2fs: %s", method, path, delay, last)
                await asyncio.sleep(delay)
        raise ServiceUnreachable(
            f"{method} {self.base_url}{path} failed after {attempts} attempt(s): {type(last).__name__}: {last}"
        )


def _json_or_text(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text
