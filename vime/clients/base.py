"""The async HTTP client every typed service client builds on, and the one retry rule.

One pooled `httpx.AsyncClient` per client (connection reuse), the bearer token on every call.
Retries follow `vime.retry.RetryPolicy` (exponential backoff with jitter) and one rule
(`may_resend`): a request that cannot have reached the service (refused connection, connect
timeout) is always sent again; one that may have been processed (the reply was lost, or a 502 /
503 / 504 came back) only when the caller says the call is idempotent. Timeouts while waiting for a
reply are not retried (the service is slow, not gone): they raise httpx's timeout error.
"""

from __future__ import annotations

import contextlib
import functools
import json
import ssl
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, TypedDict, Unpack

import httpx

from vime.retry import RetryPolicy

RETRYABLE_STATUS = frozenset({502, 503, 504})
"""Gateway answers meaning no upstream produced a reply (the router's data plane too: an engine
died before it was taken out), so an idempotent request may be sent again."""

NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
"""The request never reached the service: sending it again cannot do anything twice."""
REPLY_LOST = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
"""The connection broke after (part of) the request went out: it may have been processed."""

KEEPALIVE_EXPIRY_S = 4.0
"""Idle pooled connections are dropped before the servers' own keep-alive timeout (vLLM's uvicorn:
5 s), so a request is not sent on a connection the server is closing."""


class ServiceUnreachable(ConnectionError):
    """No answer from a service after all retries."""


class ServiceCallError(RuntimeError):
    """A service answered with an error status."""

    def __init__(self, method: str, url: str, status_code: int, message: str, body: Any = None) -> None:
        super().__init__(f"{method} {url} -> {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.body = body


class GatewayStatus(Exception):
    """An answer saying no upstream produced a reply (a `RETRYABLE_STATUS`; for the data plane also
    vllm-router's transport 500): retried for idempotent calls."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def may_resend(exc: BaseException, idempotent: bool) -> bool:
    """The one retry rule of every client (see the module docstring)."""
    if isinstance(exc, NOT_SENT):
        return True
    return idempotent and isinstance(exc, (*REPLY_LOST, GatewayStatus))


def error_message(body: httpx.Response | str | bytes) -> str:
    """The message of a vime / vLLM / FastAPI / vllm-router error body, or the raw text."""
    if isinstance(body, httpx.Response):
        body = body.content
    try:
        parsed = json.loads(body)
    except ValueError:
        return (body.decode(errors="replace") if isinstance(body, bytes) else body)[:500]
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed.get("detail"))
        if isinstance(err, dict):
            return str(err.get("message", err))[:500]
        if err is not None:
            return str(err)[:500]
    return str(parsed)[:500]


class SendOptions(TypedDict, total=False):
    """What `ServiceClient.request` and `ServiceClient.send` take besides method and path."""

    json: Any
    params: Any
    headers: dict[str, str] | None
    timeout: float | object | None
    """Seconds for this call; None waits forever; left out (or ``...``) uses the client's timeout."""
    idempotent: bool
    """Safe to send again after a lost reply or a 502/503/504 (refused connections always are)."""
    retries: int | None
    """Retries for this call; None (or left out) uses the client's."""


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """One certificate context per process: httpx builds a new one for every client otherwise, ~20 ms
    of loading the CA bundle each time, which a client made per call (a push's, per engine) pays."""
    return httpx.create_ssl_context()


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
        self.retry = RetryPolicy(attempts=retries + 1, backoff_s=backoff_s)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout or 10.0, 10.0)),
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
            transport=transport,
            verify=ssl_context(),
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
        """Send a request (retried as `send` says); return the JSON body (None when empty)."""
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
        """Like `request` but returns the raw response whatever its status (a 502/503/504 after
        the last retry of an idempotent call included)."""
        retries = options.get("retries")
        policy = self.retry if retries is None else replace(self.retry, attempts=retries + 1)
        timeout = options.get("timeout", ...)
        extra: dict[str, Any] = {} if timeout is ... else {"timeout": timeout}
        idempotent = options.get("idempotent", False)
        response: httpx.Response | None = None
        attempts = 0
        try:
            async for attempt in policy.retrying(lambda exc: may_resend(exc, idempotent)):
                with attempt:
                    attempts += 1
                    response = await self._client.request(
                        method,
                        path,
                        json=options.get("json"),
                        params=options.get("params"),
                        headers=options.get("headers"),
                        **extra,
                    )
                    if idempotent and response.status_code in RETRYABLE_STATUS:
                        raise GatewayStatus(response.status_code, error_message(response))
        except GatewayStatus:
            pass  # the last retry's 502/503/504 is the answer
        except (*NOT_SENT, *REPLY_LOST) as exc:
            raise ServiceUnreachable(
                f"{method} {self.base_url}{path} failed after {attempts} attempt(s): {type(exc).__name__}: {exc}"
            ) from exc
        assert response is not None
        if response.status_code >= 500:
            await _drop_connection(response)
        return response


async def _drop_connection(response: httpx.Response) -> None:
    """Close the connection a server error came on. Starlette re-raises the exception behind a
    500 after sending it and uvicorn then closes the connection, without saying so in the reply
    (vLLM's failed ``collective_rpc`` calls): a request sent on it meanwhile from the pool fails
    with a ``ReadError`` it never caused."""
    stream = response.extensions.get("network_stream")
    if stream is not None:
        with contextlib.suppress(Exception):
            await stream.aclose()


def _json_or_text(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text
