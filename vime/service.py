"""What every vime service shares: the FastAPI app factory, bearer auth, errors, /health, /metrics.

Each service builds its app with `create_app(name, ...)` and protects state-changing routes with
``Depends(require_token)``. Bad input never becomes a 500: pydantic errors are 422 with the field
named, oversized bodies are 413, and `ServiceError` carries its own status.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from vime.config_sections import ServicesConfig

log = logging.getLogger("vime.service")


class ServiceError(Exception):
    """An error with an HTTP status and a message for the caller."""

    def __init__(self, status_code: int, message: str, **details: Any) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.details = details


def error_body(message: str, **details: Any) -> dict[str, Any]:
    """The one error shape every vime service answers with."""
    return {"error": {"message": message, **details}}


class BodySizeLimit:
    """ASGI middleware answering 413 when a request body exceeds ``max_bytes``, or the limit
    ``per_path`` gives its path (checked while streaming)."""

    def __init__(self, app: ASGIApp, max_bytes: int, per_path: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = dict(per_path or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.per_path.get(scope.get("path", ""), self.max_bytes)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(scope, receive, send, limit)
            return
        seen = 0

        async def limited_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(scope, receive, send, limit)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        resp = JSONResponse(error_body(f"request body larger than {limit} bytes"), status_code=413)
        await resp(scope, receive, send)


class _TooLarge(Exception):
    pass


def make_token_checker(token: str | None) -> Callable[[Request], Awaitable[None]]:
    """A dependency that requires ``Authorization: Bearer <token>`` when a token is configured."""

    async def require_token(request: Request) -> None:
        if not token:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    return require_token


INSECURE_HELP = (
    "serve with no API token, every route open to whatever reaches the port "
    "(same as services.insecure=true or VIME_SERVICES__INSECURE=true)"
)


def start_token(services: ServicesConfig, name: str, *, insecure: bool = False) -> str | None:
    """The token a service starts with (``services.api_token``, else VIME_API_TOKEN).

    With none, the service refuses to start (`SystemExit` with one line saying what to set)
    unless ``--insecure`` or ``services.insecure`` says to serve open, which is logged.
    """
    token = services.token()
    if token:
        return token
    if insecure or services.insecure:
        log.warning("%s: no API token (insecure): every route is open to whatever reaches its port", name)
        return None
    raise SystemExit(
        f"vime {name}: no API token: set VIME_API_TOKEN (or services.api_token), "
        "or pass --insecure to serve with every route open"
    )


class Metrics:
    """Per-app Prometheus registry with request count and latency by route."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "vime_http_requests_total",
            "HTTP requests",
            ["service", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "vime_http_request_seconds", "HTTP request latency", ["service", "route"], registry=self.registry
        )
        self.service = service

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        """A service-specific counter in this app's registry."""
        return Counter(name, doc, list(labels), registry=self.registry)

    def histogram(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
        """A service-specific histogram in this app's registry."""
        return Histogram(name, doc, list(labels), registry=self.registry)


def create_app(
    name: str,
    *,
    version: str = "0.1.0",
    max_body_bytes: int | None = None,
    body_limits: Mapping[str, int] | None = None,
    health: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    lifespan: Any = None,
) -> FastAPI:
    """A FastAPI app with the vime conventions: /health, /metrics, error shapes, body limit.

    ``body_limits`` gives paths a body limit of their own instead of ``max_body_bytes``.
    ``app.state.metrics`` holds the `Metrics`; ``health`` may add fields to /health and raise
    `ServiceError(503, ...)` while the service is not ready.
    """
    app = FastAPI(title=f"vime {name}", version=version, lifespan=_frozen_after_start(lifespan))
    metrics = Metrics(name)
    app.state.metrics = metrics
    app.state.started_at = time.time()
    if max_body_bytes is not None:
        app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes, per_path=body_limits)

    @app.middleware("http")
    async def _observe(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        start = time.perf_counter()
        route = request.scope.get("route")
        response = await call_next(request)
        path = getattr(request.scope.get("route", route), "path", "unmatched")
        metrics.requests.labels(name, path, str(response.status_code)).inc()
        metrics.latency.labels(name, path).observe(time.perf_counter() - start)
        return response

    _add_error_handlers(app)
    _add_service_routes(app, name, metrics, health)
    return app


def freeze_heap() -> None:
    """Collect, then move what survives out of the garbage collector's later scans (``gc.freeze``)."""
    gc.collect()
    gc.freeze()


def _frozen_after_start(lifespan: Any) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """``lifespan`` (or none), then the heap built at start-up frozen (`freeze_heap`).

    A service's start (imports, a tokenizer, a manager and its engines) leaves hundreds of
    thousands of objects that live as long as it does, and every full collection walked them
    again: in the rollout service such a collection took 120-130 ms at the start of a rollout,
    while its requests were going out (bench/rollout_overhead.py). After ``gc.freeze()`` the
    collector scans only what was made since.
    """

    @contextlib.asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        async with lifespan(app) if lifespan is not None else contextlib.nullcontext():
            freeze_heap()
            yield

    return run


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as ``{"error": {"message": ...}}``; a 422 names each bad field."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{loc or 'body'}: {err.get('msg')}")
        return JSONResponse(
            error_body("invalid request: " + "; ".join(problems), fields=problems), status_code=422
        )

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, **exc.details), status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code, headers=headers)


def _add_service_routes(
    app: FastAPI, name: str, metrics: Metrics, health: Callable[[], Awaitable[dict[str, Any]]] | None
) -> None:
    """``GET /health`` (with the service's own fields) and ``GET /metrics`` (Prometheus)."""

    @app.get("/health")
    async def _health() -> dict[str, Any]:
        extra = await health() if health is not None else {}
        return {
            "status": "ok",
            "service": name,
            "uptime_s": round(time.time() - app.state.started_at, 3),
            **extra,
        }

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


GRACEFUL_SHUTDOWN_S = 5
"""After SIGTERM, requests still in flight get this long before the service shuts down (cancelling
them; a waiting ``POST /v1/weights/push`` would otherwise hold a trainer's stop for as long as it
waits), so a service answers SIGTERM within seconds."""


def server_config(
    app: FastAPI, host: str, port: int, log_level: str = "warning", uds: str | None = None
) -> Any:
    """Every service's uvicorn settings (a ``uvicorn.Config``); ``uds``: a Unix socket instead of
    ``host:port``."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        uds=uds,
        log_level=log_level,
        access_log=False,
        timeout_keep_alive=75,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def serve(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str = "warning",
    *,
    uds: str | None = None,
    on_signal: Callable[[], None] | None = None,
) -> None:
    """Run an app with uvicorn (uvloop + httptools when installed). ``on_signal``: called on the
    event loop as soon as SIGTERM or SIGINT arrives, before uvicorn's graceful shutdown (up to
    ``GRACEFUL_SHUTDOWN_S`` for open requests, then the lifespan's end), for work that must stop
    where the signal found it instead of going on meanwhile."""
    import uvicorn

    class Server(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None

        async def serve(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if on_signal is not None and self.loop is not None and not self.should_exit:
                self.loop.call_soon_threadsafe(on_signal)  # this runs as a signal handler
            super().handle_exit(sig, frame)

    Server(server_config(app, host, port, log_level, uds)).run()
