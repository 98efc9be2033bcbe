"""The router's control plane (FastAPI): register, list, drain and remove engines.

Routes (state-changing ones need the services' bearer token):

- ``POST /v1/engines`` {url, id?, gpu_ids?} → 201 (200 when already registered; 422 when it does not
  answer ``/health``, or neither ``/version`` nor ``/server_info`` as a vLLM engine does): serving
  at once, until it is removed or drained. The router judges no engine's health; the registrant
  takes out the engines that stop serving.
- ``GET /v1/engines`` (token: the data plane in it names vllm-router's private port) → every engine
  (draining, routable) + the data plane
- ``GET /v1/engines/{id}`` → one engine, its in-flight count read now
- ``DELETE /v1/engines/{id}`` → out of the data plane at once; in-flight requests finish
- ``POST /v1/engines/{id}/drain`` / ``/undrain`` → no new requests / serving again
- ``GET /v1/data-plane`` (token: it names vllm-router's private port) ``GET /health``, ``GET /metrics``
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vime.service import create_app, make_token_checker
from vime.wire.router import DataPlaneStatus, EngineList, EngineRegistration, RegisteredEngine
from vime_router.service import RouterService


class RouterCollector(Collector):
    """Engine and data-plane state, read at scrape time."""

    def __init__(self, service: RouterService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        routable = GaugeMetricFamily(
            "vime_router_engine_routable", "1 if the engine gets new requests", labels=["engine"]
        )
        draining = GaugeMetricFamily(
            "vime_router_engine_draining", "1 if the engine is drained", labels=["engine"]
        )
        for e in svc.registry.engines.values():
            st = svc.status(e)
            routable.add_metric([e.id], float(st.routable))
            draining.add_metric([e.id], float(st.draining))
        yield from (routable, draining)
        dp = svc.data_plane_status()
        yield GaugeMetricFamily(
            "vime_router_data_plane_ready", "1 if vllm-router and the filter run", value=float(dp.ready)
        )
        yield CounterMetricFamily(
            "vime_router_data_plane_restarts", "data-plane process restarts", value=dp.restarts
        )
        yield CounterMetricFamily(
            "vime_router_forwarded_requests", "requests passed to vllm-router", value=dp.forwarded
        )
        yield CounterMetricFamily(
            "vime_router_refused_requests", "requests refused by the filter", value=dp.refused
        )
        yield GaugeMetricFamily(
            "vime_router_in_flight", "requests forwarded, not yet answered", value=dp.in_flight
        )
        yield CounterMetricFamily(
            "vime_router_sync_errors", "failed syncs of vllm-router's worker list", value=svc.sync_errors
        )


def build_app(service: RouterService, token: str | None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = create_app("router", health=service.health, lifespan=lifespan, max_body_bytes=64 * 1024)
    app.state.metrics.registry.register(RouterCollector(service))
    app.state.service = service
    auth = [Depends(make_token_checker(token))]

    @app.post("/v1/engines", response_model=RegisteredEngine, status_code=201, dependencies=auth)
    async def register(reg: EngineRegistration, response: Response) -> Any:
        status, created = await service.register(reg)
        if not created:
            response.status_code = 200
        return status

    @app.get("/v1/engines", response_model=EngineList, dependencies=auth)
    async def list_engines() -> Any:
        return service.listing()

    @app.get("/v1/engines/{engine_id}", response_model=RegisteredEngine)
    async def get_engine(engine_id: str) -> Any:
        return await service.refresh(engine_id)

    @app.delete("/v1/engines/{engine_id}", response_model=RegisteredEngine, dependencies=auth)
    async def deregister(engine_id: str) -> Any:
        return await service.deregister(engine_id)

    @app.post("/v1/engines/{engine_id}/drain", response_model=RegisteredEngine, dependencies=auth)
    async def drain(engine_id: str) -> Any:
        return await service.set_draining(engine_id, True)

    @app.post("/v1/engines/{engine_id}/undrain", response_model=RegisteredEngine, dependencies=auth)
    async def undrain(engine_id: str) -> Any:
        return await service.set_draining(engine_id, False)

    @app.get("/v1/data-plane", response_model=DataPlaneStatus, dependencies=auth)
    async def data_plane() -> Any:
        return service.data_plane_status()

    return app
