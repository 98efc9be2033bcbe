"""The router service's state: registry and data plane, and keeping them in step.

`RouterService.sync()` is the one place vllm-router's worker list is changed: after every
registration / removal / drain, every vllm-router (re)start (a restarted vllm-router starts empty
and is refilled from the registry), and every `SYNC_INTERVAL_S` (a failed sync is tried again;
vllm-router's private port is open to any process on the host, so a worker no registration put
there is removed by the next sync, with a warning).
The service judges no engine's health: registering checks once that the engine answers, and from
then on the registrant says when it stops serving (DELETE, or drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from vime.config import RouterConfig
from vime.service import ServiceError
from vime.wire.engine_metrics import IN_FLIGHT, metric_sum
from vime.wire.router import DataPlaneStatus, EngineList, EngineRegistration, RegisteredEngine
from vime_router.data_plane import WORKER_ADD_TIMEOUT_S, DataPlane, DataPlaneSpec
from vime_router.registry import Engine, Registry
from vime_router.workers import RouterWorkers, WorkerSyncError

log = logging.getLogger("vime.router")

SYNC_INTERVAL_S = 2.0
ENGINE_ID_PATHS = ("/version", "/server_info")
"""vLLM answers ``/version`` always and ``/server_info`` in dev mode (the reference engine both)."""
ENGINE_CALL_TIMEOUT_S = 5.0
"""The one ``/health`` check at registration, and each ``/metrics`` read for an in-flight count."""


class RouterService:
    """Everything the control-plane routes act on."""

    def __init__(self, config: RouterConfig, spec: DataPlaneSpec) -> None:
        self.config = config
        self.registry = Registry()
        self.workers = RouterWorkers(spec.router_url, timeout_s=WORKER_ADD_TIMEOUT_S + 5)
        self.data_plane = DataPlane(spec, on_router_start=self.sync_quietly)
        self._http = httpx.AsyncClient(
            timeout=ENGINE_CALL_TIMEOUT_S, limits=httpx.Limits(max_keepalive_connections=0)
        )
        self.filter_counts: dict[str, int] = {}
        self.sync_errors = 0
        self.placed: set[str] = set(self.data_plane.placeholders.urls)
        """Every URL this service ever asked vllm-router to serve (its start-up placeholders too)."""
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.data_plane.start()
        self._tasks = [
            asyncio.create_task(self.data_plane.supervise(), name="data-plane-supervisor"),
            asyncio.create_task(self._keep_in_step(), name="keep-in-step"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.data_plane.stop()
        await self._http.aclose()
        await self.workers.aclose()

    async def _keep_in_step(self) -> None:
        """The filter's counters, and vllm-router's worker list re-synced with the registry."""
        while True:
            await asyncio.sleep(SYNC_INTERVAL_S)
            self.filter_counts = await self.data_plane.filter_counts() or self.filter_counts
            await self.sync_quietly()

    # --- syncing vllm-router's worker list ----------------------------------------------------
    async def sync(self) -> None:
        """Make vllm-router serve exactly the routable engines; raises 503 when it cannot."""
        desired = self.registry.routable_urls()
        self.placed |= desired
        try:
            added, removed = await self.workers.sync(desired)
        except WorkerSyncError as exc:
            self.sync_errors += 1
            raise ServiceError(
                503, f"state recorded, but the data plane was not updated yet (it retries): {exc}"
            ) from None
        if added or removed:
            log.info("data plane workers: +%s -%s", sorted(added), sorted(removed))
        if foreign := removed - self.placed:
            log.warning(
                "vllm-router was serving %s, which no registration put there (a process on this "
                "host called its private port): removed",
                sorted(foreign),
            )

    async def sync_quietly(self) -> None:
        with contextlib.suppress(ServiceError):
            await self.sync()

    # --- what the routes do -------------------------------------------------------------------
    def status(self, engine: Engine, in_flight: int | None = None) -> RegisteredEngine:
        return engine.status(in_data_plane=engine.url in self.workers.last_seen, in_flight=in_flight)

    async def register(self, reg: EngineRegistration) -> tuple[RegisteredEngine, bool]:
        """Add an engine (it must answer ``/health`` and, as a vLLM engine does, ``/version`` or
        ``/server_info`` now: 422 otherwise) and put it in the data plane."""
        if reg.engine_id() not in self.registry.engines:
            await self._check_engine(reg.url)
        engine, created = self.registry.register(reg)
        await self.sync()
        return self.status(engine), created

    async def _check_engine(self, url: str) -> None:
        """422 unless ``url`` is a serving engine: any server answering ``/health`` (another vime
        service) would otherwise get generate traffic routed to it."""
        error = await self._answers(url, "/health")
        if error is not None:
            raise ServiceError(
                422, f"url: {url} does not answer GET /health ({error}); register it once it does"
            )
        errors = [await self._answers(url, path, json=True) for path in ENGINE_ID_PATHS]
        if all(errors):
            raise ServiceError(
                422,
                f"url: {url} is not an inference engine: GET {' and '.join(ENGINE_ID_PATHS)} do not "
                f"answer as vLLM's do ({'; '.join(e or '' for e in errors)})",
            )

    async def _answers(self, url: str, path: str, json: bool = False) -> str | None:
        """None when ``GET url+path`` answers 200 (with a JSON object if ``json``), else why not."""
        try:
            r = await self._http.get(f"{url}{path}")
        except httpx.HTTPError as exc:
            return f"{path}: {type(exc).__name__}: {exc}"[:200]
        if r.status_code != 200:
            return f"{path}: HTTP {r.status_code}"
        if json:
            try:
                if not isinstance(r.json(), dict):
                    return f"{path}: not a JSON object"
            except ValueError:
                return f"{path}: not JSON"
        return None

    async def deregister(self, engine_id: str) -> RegisteredEngine:
        engine = self.registry.remove(engine_id)
        await self.sync()
        return engine.status(in_data_plane=False)

    async def set_draining(self, engine_id: str, draining: bool) -> RegisteredEngine:
        engine = self.registry.get(engine_id)
        engine.draining = draining
        await self.sync()
        return self.status(engine)

    async def refresh(self, engine_id: str) -> RegisteredEngine:
        """One engine with its in-flight count read now from its ``/metrics``."""
        engine = self.registry.get(engine_id)
        return self.status(engine, in_flight=await self.in_flight(engine.url))

    async def in_flight(self, url: str) -> int | None:
        """The engine's running + waiting requests; None if it does not say (or does not answer)."""
        try:
            r = await self._http.get(f"{url}/metrics")
        except httpx.HTTPError:
            return None
        total = metric_sum(r.content, IN_FLIGHT) if r.status_code == 200 else None
        return None if total is None else round(total)

    def data_plane_status(self) -> DataPlaneStatus:
        router_pid, filter_pid = self.data_plane.pids()
        return DataPlaneStatus(
            url=self.data_plane.spec.public_url,
            router_url=self.data_plane.spec.router_url,
            policy=self.config.policy,
            ready=self.data_plane.ready,
            router_pid=router_pid,
            filter_pid=filter_pid,
            restarts=self.data_plane.restarts,
            workers=list(self.workers.last_seen),
            forwarded=self.filter_counts.get("forwarded", 0),
            refused=self.filter_counts.get("refused", 0),
            in_flight=self.filter_counts.get("in_flight", 0),
        )

    def listing(self) -> EngineList:
        engines = [self.status(e) for e in self.registry.engines.values()]
        return EngineList(engines=engines, data_plane=self.data_plane_status())

    async def health(self) -> dict[str, Any]:
        dp = self.data_plane_status()
        if not dp.ready:
            raise ServiceError(
                503,
                "the data plane (vllm-router + route filter) is not running",
                data_plane=dp.model_dump(exclude={"router_url"}),
            )
        routable = sum(1 for e in self.registry.engines.values() if self.status(e).routable)
        return {
            "data_plane": dp.model_dump(exclude={"router_url"}),  # a private port: behind the token
            "engines": len(self.registry.engines),
            "routable_engines": routable,
        }
