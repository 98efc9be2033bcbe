"""The router service's state: registry, data plane, health checks, and keeping them in step.

`RouterService.sync()` is the one place vllm-router's worker list is changed: after every probe
round, every registration / removal / drain, and every vllm-router (re)start (a restarted
vllm-router starts empty and is refilled from the registry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from vime.config import RouterConfig
from vime.service import ServiceError
from vime.wire.router import DataPlaneStatus, EngineList, EngineRegistration, EngineStatus
from vime_router.data_plane import DataPlane, DataPlaneSpec
from vime_router.prober import Prober
from vime_router.registry import Engine, Registry
from vime_router.workers import RouterWorkers, WorkerSyncError

log = logging.getLogger("vime.router")


class RouterService:
    """Everything the control-plane routes act on."""

    def __init__(self, config: RouterConfig, spec: DataPlaneSpec) -> None:
        self.config = config
        self.registry = Registry(config.health_failure_threshold, config.health_success_threshold)
        self.workers = RouterWorkers(spec.router_url, timeout_s=config.health_check_timeout_s * 5 + 5)
        self.data_plane = DataPlane(spec, on_router_start=self.sync_quietly)
        self.prober = Prober(
            self.registry,
            interval_s=config.health_check_interval_s,
            timeout_s=config.health_check_timeout_s,
            on_change=self.sync_quietly,
        )
        self.gate_counters: dict[str, int] = {}
        self.sync_errors = 0
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.data_plane.start()
        self._tasks = [
            asyncio.create_task(self.data_plane.supervise(), name="data-plane-supervisor"),
            asyncio.create_task(self.prober.run(), name="health-checks"),
            asyncio.create_task(self._poll_gate(), name="filter-counters"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.data_plane.stop()
        await self.prober.aclose()
        await self.workers.aclose()

    async def _poll_gate(self) -> None:
        while True:
            self.gate_counters = await self.data_plane.gate_stats() or self.gate_counters
            await asyncio.sleep(max(1.0, self.config.health_check_interval_s))

    # --- syncing vllm-router's worker list ----------------------------------------------------
    async def sync(self) -> None:
        """Make vllm-router serve exactly the routable engines; raises 503 when it cannot."""
        try:
            added, removed = await self.workers.sync(self.registry.routable_urls())
        except WorkerSyncError as exc:
            self.sync_errors += 1
            raise ServiceError(
                503, f"state recorded, but the data plane was not updated yet (it retries): {exc}"
            ) from None
        if added or removed:
            log.info("data plane workers: +%s -%s", sorted(added), sorted(removed))

    async def sync_quietly(self) -> None:
        with contextlib.suppress(ServiceError):
            await self.sync()

    # --- what the routes do -------------------------------------------------------------------
    def status(self, engine: Engine) -> EngineStatus:
        return engine.status(in_data_plane=engine.url in self.workers.last_seen)

    async def register(self, reg: EngineRegistration) -> tuple[EngineStatus, bool]:
        engine, created = self.registry.register(reg)
        if not engine.healthy:
            await self.prober.check(engine)
        await self.sync()
        return self.status(engine), created

    async def deregister(self, engine_id: str) -> EngineStatus:
        engine = self.registry.remove(engine_id)
        await self.sync()
        return engine.status(in_data_plane=False)

    async def set_draining(self, engine_id: str, draining: bool) -> EngineStatus:
        engine = self.registry.get(engine_id)
        engine.draining = draining
        await self.sync()
        return self.status(engine)

    async def refresh(self, engine_id: str) -> EngineStatus:
        """One engine with its in-flight count read now (health verdicts stay with the prober)."""
        engine = self.registry.get(engine_id)
        in_flight = await self.prober.in_flight(engine)
        if in_flight is not None:
            engine.in_flight = in_flight
        return self.status(engine)

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
            forwarded=self.gate_counters.get("forwarded", 0),
            refused=self.gate_counters.get("refused", 0),
            in_flight=self.gate_counters.get("in_flight", 0),
        )

    def listing(self) -> EngineList:
        engines = [self.status(e) for e in self.registry.engines.values()]
        return EngineList(engines=engines, data_plane=self.data_plane_status())

    async def health(self) -> dict[str, Any]:
        dp = self.data_plane_status()
        if not dp.ready:
            raise ServiceError(
                503, "the data plane (vllm-router + route filter) is not running", data_plane=dp.model_dump()
            )
        routable = sum(1 for e in self.registry.engines.values() if e.routable)
        return {
            "data_plane": dp.model_dump(),
            "engines": len(self.registry.engines),
            "routable_engines": routable,
        }
