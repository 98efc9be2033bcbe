"""In-process stand-ins for the engines the trainer's weight sync drives, recording what was asked.

- `FakeEngines`: a FastAPI app with vLLM's control routes (pause, reset_prefix_cache, weight
  update session, resume) that records every call and can fail on cue; refuses an update while
  its weights are asleep, as the reference engine does.
- `FakeTransport`: buckets without files or GPUs.
- `engine_info`: an engine as the rollout manager lists it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse

from vime.clients.engine import EngineClient
from vime.wire.rollout import (
    EngineInfo,
)

# --- engines --------------------------------------------------------------------------------


@dataclass
class EngineState:
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    paused: str | None = None
    update_active: bool = False
    version: str | None = None
    weights_asleep: bool = False
    loaded: list[Any] = field(default_factory=list)
    reset_failures: int = 0
    """``/reset_prefix_cache`` answers success=false this many times first."""
    fail_update_at: int | None = None
    """``/update_weights`` answers 500 for this bucket index."""
    update_s: float = 0.0
    """How long ``/update_weights`` takes to load a bucket."""
    gone: bool = False
    """Every call answers 502, as an engine's gate does with no engine behind it."""


class FakeEngines:
    """Engines behind one ASGI app, told apart by host name (http://e0, http://e1, ...)."""

    def __init__(self, n: int) -> None:
        self.states = {f"http://e{i}": EngineState() for i in range(n)}
        self.app = self._build()

    def urls(self) -> list[str]:
        return list(self.states)

    def client(self, url: str) -> EngineClient:
        return EngineClient(url, transport=httpx.ASGITransport(app=self.app), retries=0)

    def state(self, request: Request) -> EngineState:
        return self.states[f"http://{request.url.hostname}"]

    def _build(self) -> FastAPI:
        app = FastAPI()
        state = self.state

        @app.middleware("http")
        async def gate(request: Request, call_next: Any) -> Any:
            if state(request).gone:
                return JSONResponse({"error": "the engine did not answer: Bad Gateway"}, status_code=502)
            return await call_next(request)

        @app.post("/pause")
        async def pause(
            request: Request, mode: str = Query("abort"), clear_cache: str = Query("true")
        ) -> Any:
            s = state(request)
            s.calls.append(("pause", {"mode": mode, "clear_cache": clear_cache}))
            s.paused = mode
            return {"status": "paused"}

        @app.post("/resume")
        async def resume(request: Request) -> Any:
            s = state(request)
            s.calls.append(("resume", {}))
            s.paused = None
            return {"status": "resumed"}

        @app.post("/reset_prefix_cache")
        async def reset(request: Request) -> Any:
            s = state(request)
            s.calls.append(("reset_prefix_cache", dict(request.query_params)))
            if s.reset_failures > 0:
                s.reset_failures -= 1
                return {"success": False}
            return {"success": True}

        self._weight_routes(app)
        return app

    def _weight_routes(self, app: FastAPI) -> None:
        state = self.state

        def error(status: int, message: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message}}, status_code=status)

        @app.post("/init_weight_transfer_engine")
        async def init(request: Request) -> Any:
            state(request).calls.append(("init_weight_transfer_engine", (await request.json())["init_info"]))
            return {"message": "Weight transfer initialized"}

        @app.post("/start_weight_update")
        async def start(request: Request) -> Any:
            s = state(request)
            s.calls.append(("start_weight_update", {}))
            if s.update_active:
                return error(400, "already active")
            s.update_active = True
            return {"message": "Weight update started"}

        @app.post("/update_weights")
        async def update(request: Request) -> Any:
            s = state(request)
            info = (await request.json())["update_info"]
            s.calls.append(("update_weights", info))
            if not s.update_active:
                return error(400, "start_weight_update must be called first")
            if s.weights_asleep:
                return error(400, "weights are asleep")
            if s.fail_update_at is not None and info.get("index") == s.fail_update_at:
                return error(500, "worker failed to load the bucket")
            await asyncio.sleep(s.update_s)
            s.loaded.append(info)
            return {"message": "Weights updated"}

        @app.post("/finish_weight_update")
        async def finish(request: Request) -> Any:
            s = state(request)
            body = (await request.body()).strip()
            version = (await request.json()).get("weight_version") if body else None
            s.calls.append(("finish_weight_update", {"weight_version": version}))
            if not s.update_active:
                return error(400, "no active update")
            s.update_active = False
            if version is not None:
                s.version = str(version)
            return {"message": "Weight update finished"}


# --- weights --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeBucket:
    index: int
    nbytes: int = 100
    num_tensors: int = 2

    def update_info(self, engine: EngineInfo) -> dict[str, Any]:
        return {"backend": "fake", "index": self.index, "engine": engine.url}


class FakeTransport:
    """``n`` buckets; records when each is released (the next one asked for) and closes."""

    name = "fake"

    def __init__(
        self,
        n: int = 3,
        on_bucket: Callable[[int], None] | None = None,
        init_info: dict[str, Any] | None = None,
    ) -> None:
        self.n = n
        self.init_info = init_info
        self.released: list[int] = []
        self.closed = 0
        self.on_bucket = on_bucket

    def buckets(self, engines: Sequence[EngineInfo]) -> Iterator[FakeBucket]:
        try:
            for i in range(self.n):
                if self.on_bucket is not None:
                    self.on_bucket(i)
                try:
                    yield FakeBucket(i)
                finally:
                    self.released.append(i)
        finally:
            self.closed += 1


def engine_info(url: str, index: int, **kw: Any) -> EngineInfo:
    """An engine as the rollout manager lists it: ready and registered with the router."""
    return EngineInfo(index=index, url=url, backend="fake", status="ready", registered=True, **kw)
