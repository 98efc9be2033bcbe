"""The trainer service's REST API: runs, their status and events, weight pushes, checkpoints.

State-changing routes need the bearer token. Errors are answers: a second active run is 409, an
unknown run 404, a bad config or a field the run does not apply 422 naming it, a push or
checkpoint with no active run, or while the run starts up or stops (it would wait minutes, or
never be served), 409 at once, one the run ended before serving 409, one it could not serve 502
with the cause.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Query, Request, Response
from prometheus_client import Gauge

from vime.service import ServiceError, create_app, make_token_checker
from vime.wire.bounds import MAX_ID
from vime.wire.trainer import (
    STEP_PHASES,
    Accepted,
    CheckpointRequest,
    CheckpointResult,
    PushRequest,
    PushResult,
    RunEvents,
    RunList,
    RunPhase,
    RunRequest,
    RunState,
    RunStatus,
    StepRecord,
)
from vime_trainer.runs import RunHandle, RunRegistry
from vime_trainer.state import RunEnded

MAX_BODY_BYTES = 1024 * 1024
"""A run request is a config override: small."""


def build_app(registry: RunRegistry, *, token: str | None, on_shutdown: Any = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await registry.aclose()
            if on_shutdown is not None:
                await asyncio.to_thread(on_shutdown)

    async def health() -> dict[str, Any]:
        active = registry.active
        status = active.ctx.status if active is not None and active.busy else None
        return {
            "active_run": status.run_id if status else None,
            "phase": status.phase.value if status else None,
            "rollout_id": status.rollout_id if status else None,
            "weight_version": status.weight_version if status else None,
        }

    app = create_app("trainer", max_body_bytes=MAX_BODY_BYTES, health=health, lifespan=lifespan)
    app.state.registry = registry
    auth = [Depends(make_token_checker(token))]
    registry.on_step = _step_gauges(app)
    _add_run_routes(app, registry, auth)
    _add_request_routes(app, registry, auth)
    return app


def _step_gauges(app: FastAPI) -> Any:
    reg = app.state.metrics.registry
    phase_s = Gauge(
        "vime_trainer_phase_seconds", "Seconds of each T_step phase in the last step", ["phase"], registry=reg
    )
    step_s = Gauge("vime_trainer_step_seconds", "T_step of the last step", registry=reg)
    version = Gauge("vime_trainer_weight_version", "Weight version the engines hold", registry=reg)
    rollout = Gauge("vime_trainer_rollout_id", "Rollout id of the last finished step", registry=reg)
    steps = app.state.metrics.counter("vime_trainer_steps_total", "Finished steps")

    def on_step(step: StepRecord) -> None:
        for phase in STEP_PHASES:
            phase_s.labels(phase).set(getattr(step.timings, f"{phase}_s"))
        step_s.set(step.timings.step_s)
        version.set(step.weight_version)
        rollout.set(step.rollout_id)
        steps.inc()

    return on_step


def _add_run_routes(app: FastAPI, registry: RunRegistry, auth: list[Any]) -> None:
    @app.post("/v1/runs", response_model=RunStatus, status_code=201, dependencies=auth)
    async def start_run(body: RunRequest) -> RunStatus:
        handle = await registry.start(body)
        return handle.ctx.status

    @app.get("/v1/runs", response_model=RunList)
    async def list_runs() -> RunList:
        active = registry.active
        return RunList(
            runs=[h.ctx.status for h in registry.runs.values()],
            active=active.ctx.run_id if active is not None and active.busy else None,
        )

    @app.get("/v1/runs/{run_id}", response_model=RunStatus)
    async def get_run(run_id: str) -> RunStatus:
        return registry.get(run_id).ctx.status

    @app.get("/v1/runs/{run_id}/events", response_model=RunEvents)
    async def get_events(run_id: str, since: int = Query(0, ge=0, le=MAX_ID)) -> RunEvents:
        handle = registry.get(run_id)
        return RunEvents(run_id=run_id, events=handle.ctx.events.since(since))

    @app.post("/v1/runs/{run_id}/stop", response_model=RunStatus, status_code=202, dependencies=auth)
    async def stop_run(run_id: str) -> RunStatus:
        handle = registry.get(run_id)
        if not handle.busy:
            raise ServiceError(409, f"run {run_id} already ended ({handle.ctx.status.state.value})")
        handle.ctx.request_stop()
        return handle.ctx.status


def _add_request_routes(app: FastAPI, registry: RunRegistry, auth: list[Any]) -> None:
    @app.post("/v1/weights/push", response_model=PushResult | Accepted, dependencies=auth)
    async def push(
        request: Request, response: Response, body: PushRequest | None = None
    ) -> PushResult | Accepted:
        handle = _servable(registry.require_active(), "weight push")
        fut = handle.ctx.request_push()
        return await _served(fut, body, response, handle.ctx.run_id, "weights.push", "weight push")

    @app.post("/v1/checkpoints", response_model=CheckpointResult | Accepted, dependencies=auth)
    async def checkpoint(
        response: Response, body: CheckpointRequest | None = None
    ) -> CheckpointResult | Accepted:
        handle = _servable(registry.require_active(), "checkpoint")
        fut = handle.ctx.request_checkpoint()
        return await _served(fut, body, response, handle.ctx.run_id, "checkpoint", "checkpoint")


def _servable(handle: RunHandle, what: str) -> RunHandle:
    """409 when the run will not serve a push or checkpoint soon: it is stopping (it may never
    get to one; the stop checkpoints the last step itself) or still starting up (the first one
    comes after start-up, the warm-up and the first push, which can take minutes)."""
    status = handle.ctx.status
    if status.state is RunState.STOPPING:
        raise ServiceError(
            409,
            f"run {status.run_id} is stopping: no {what} now (the stop checkpoints its last step; "
            f"GET /v1/runs/{status.run_id} shows it)",
        )
    if status.phase in (RunPhase.STARTING, RunPhase.WARMUP):
        raise ServiceError(
            409,
            f"run {status.run_id} is starting up (phase {status.phase.value}): a {what} is served "
            "between steps; ask again once its first rollout has begun",
        )
    return handle


async def _served(
    fut: asyncio.Future[Any],
    body: PushRequest | CheckpointRequest | None,
    response: Response,
    run_id: str,
    action: str,
    what: str,
) -> Any:
    """The request's result once the run has served it (502 with the cause if it could not), or
    202 `Accepted` at once when the body says not to wait."""
    if body is not None and not body.wait:
        response.status_code = 202
        return Accepted(run_id=run_id, accepted=action)
    try:
        return await asyncio.shield(fut)
    except RunEnded as exc:
        raise ServiceError(409, f"{what} not done: {exc}") from None
    except RuntimeError as exc:
        raise ServiceError(502, f"{what} not done: {exc}") from None
