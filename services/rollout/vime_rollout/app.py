"""The rollout manager's REST API (DESIGN.md §2): rollouts, warm-up batches, engine memory, weight
bookkeeping, admission, data-source state. State-changing routes need the bearer token.

A rollout with ``"publish": false`` (a preview, `vime rollout`) returns its samples in the job and
publishes nothing, so no run ever trains on it.

Errors are answers, not 500s: a rollout while engines sleep (or, for a training rollout, while
admission is paused) is a 409, a second concurrent rollout a 409, an unknown job a 404, a rollout
whose engines, router or reward service failed a 502 with the cause.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi import Path as PathParam
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from vime.algorithms import step_multiple
from vime.service import ServiceError, create_app, make_token_checker
from vime.wire.bounds import MAX_ID
from vime.wire.rollout import (
    OFFLOAD_LEVEL,
    AdmissionResult,
    DataSourceState,
    EngineInfo,
    EnginesStatus,
    EngineState,
    JobState,
    MemoryResult,
    OffloadRequest,
    OnloadRequest,
    ResumeAdmissionRequest,
    RolloutJob,
    RolloutRequest,
    SftBatch,
    SftBatchRequest,
    TrainingCompleted,
    UpdatableEngines,
    UpdateLockRequest,
    WeightsLoadedRequest,
)
from vime_rollout.batch_builder import BatchBuildError
from vime_rollout.data import DataStateError
from vime_rollout.engines.records import EngineRecord, LockHeld
from vime_rollout.jobs import JobConflict
from vime_rollout.manager import RolloutManager
from vime_rollout.producer_routes import add_producer_routes
from vime_rollout.sft import SftLabelError

REPORT_TIMEOUT_S = 2.0
MAX_BODY_BYTES = 1024 * 1024
"""Every request but a data-source state is a few fields (413 above)."""
STATE_BODY_BYTES = 64 * 1024 * 1024
"""A data-source state carries the handed-back partial samples (``PUT /v1/data-source/state``)."""


def engine_info(rec: EngineRecord, reported: str | None = None) -> EngineInfo:
    return EngineInfo(
        index=rec.spec.index,
        url=rec.url,
        backend=rec.spec.backend,
        status=rec.status,
        registered=rec.registered,
        gpu_ids=list(rec.spec.gpu_ids),
        pid=getattr(rec.process, "pid", None),
        weight_version=rec.weight_version,
        reported_weight_version=reported,
        needs_weights=rec.status is EngineState.NEEDS_WEIGHTS,
        asleep=sorted(rec.asleep),
        restarts=rec.restarts,
        last_error=rec.last_error,
    )


def engines_status(m: RolloutManager, reported: dict[str, str | None] | None = None) -> EnginesStatus:
    return EnginesStatus(
        engines=[engine_info(r, (reported or {}).get(r.url)) for r in m.engines.records],
        weight_version=m.engines.current_version,
        health_monitor_paused=m.monitor.paused,
        update_lock_held=m.engines.lock.held(),
        mode=m.cfg.mode,
    )


class EngineCollector(Collector):
    """Engines by status, restarts and the weight version, read at scrape time."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        m: RolloutManager | None = getattr(self.app.state, "manager", None)
        if m is None:
            return
        by_status = GaugeMetricFamily("vime_rollout_engines", "Engines by status", labels=["status"])
        for status in EngineState:
            by_status.add_metric([status.value], float(sum(r.status is status for r in m.engines.records)))
        yield by_status
        restarts = CounterMetricFamily("vime_rollout_engine_restarts", "Engine restarts", labels=["engine"])
        for r in m.engines.records:
            restarts.add_metric([r.spec.name], float(r.restarts))
        yield restarts
        yield GaugeMetricFamily(
            "vime_rollout_weight_version",
            "Weight version the trainer last reported",
            value=m.engines.current_version,
        )


def build_app(
    start: Callable[[], Awaitable[RolloutManager]], *, token: str | None, default_dp_size: int
) -> FastAPI:
    """The app; ``start`` builds the manager (engines included) before the first request is served."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.manager = await start()
        try:
            yield
        finally:
            await app.state.manager.aclose()

    async def health() -> dict[str, Any]:
        m: RolloutManager | None = getattr(app.state, "manager", None)
        if m is None:
            raise ServiceError(503, "starting")
        return {
            "engines_serving": len(m.engines.serving()),
            "engines": len(m.engines.records),
            "weight_version": m.engines.current_version,
            "rollout_running": m.jobs.running.job_id if m.jobs.running else None,
            "mode": m.cfg.mode,
        }

    app = create_app(
        "rollout",
        max_body_bytes=MAX_BODY_BYTES,
        body_limits={"/v1/data-source/state": STATE_BODY_BYTES},
        health=health,
        lifespan=lifespan,
    )
    app.state.metrics.registry.register(EngineCollector(app))
    auth = [Depends(make_token_checker(token))]

    def mgr(request: Request) -> RolloutManager:
        return request.app.state.manager

    _add_rollout_routes(app, mgr, auth, default_dp_size)
    _add_engine_routes(app, mgr, auth)
    _add_control_routes(app, mgr, auth)
    add_producer_routes(app, mgr, auth, _check_dp_size)
    return app


def _add_rollout_routes(app: FastAPI, mgr: Any, auth: list[Any], default_dp_size: int) -> None:
    metrics = app.state.metrics
    rollouts = metrics.counter("vime_rollouts_total", "Rollout jobs by kind and outcome", ("kind", "state"))
    seconds = metrics.histogram("vime_rollout_seconds", "Wall time of rollout jobs", ("kind",))
    tokens = metrics.counter("vime_rollout_generated_tokens_total", "Tokens generated by rollouts")

    @app.post("/v1/rollouts", response_model=RolloutJob, dependencies=auth)
    async def post_rollout(body: RolloutRequest, request: Request, response: Response) -> RolloutJob:
        m: RolloutManager = mgr(request)
        dp = body.dp_size or default_dp_size
        preview = not body.publish and not body.evaluation
        if not body.evaluation and not preview:
            _check_dp_size(m, dp)
        if body.evaluation and not m.eval_data:
            raise ServiceError(400, "no eval dataset configured (data.eval_prompt_data)")
        if preview or m.jobs.find(body.rollout_id, body.evaluation) is None:
            m.check_can_roll_out(body.evaluation, publish=not preview)

        async def run(job: RolloutJob) -> None:
            kind = "eval" if body.evaluation else "preview" if preview else "train"
            outcome, start = "failed", time.perf_counter()
            try:
                if body.evaluation:
                    await m.run_eval(job)
                else:
                    await (m.run_preview(job) if preview else m.run_training(job, dp))
                outcome = "ok"
            finally:
                rollouts.labels(kind, outcome).inc()
                seconds.labels(kind).observe(time.perf_counter() - start)
                tokens.inc(job.metrics.get("rollout/generated_tokens", 0.0))

        try:
            job, _ = m.jobs.submit(body.rollout_id, body.evaluation, run, preview=preview)
        except JobConflict as exc:
            raise ServiceError(409, str(exc)) from None
        if not body.wait:
            response.status_code = 202 if job.state is JobState.RUNNING else 200
            return job
        await m.jobs.wait(job)
        if job.state is JobState.FAILED:
            raise ServiceError(502, f"rollout {job.rollout_id} failed: {job.error}", job_id=job.job_id)
        return job

    @app.post("/v1/sft-batches", response_model=SftBatch, dependencies=auth)
    async def post_sft_batch(body: SftBatchRequest, request: Request) -> SftBatch:
        """The trainer's supervised warm-up step (engines not needed: they may sleep)."""
        m: RolloutManager = mgr(request)
        dp = body.dp_size or default_dp_size
        _check_dp_size(m, dp)
        try:
            return await m.publish_sft(body.step, dp)
        except (SftLabelError, BatchBuildError) as exc:
            raise ServiceError(422, str(exc)) from None
        except RedisError as exc:
            raise ServiceError(503, f"Redis: {type(exc).__name__}: {exc}") from None

    @app.get("/v1/rollouts/{job_id}", response_model=RolloutJob)
    async def get_rollout(job_id: str, request: Request) -> RolloutJob:
        job = mgr(request).jobs.get(job_id)
        if job is None:
            raise ServiceError(404, f"no rollout job {job_id!r}")
        return job


def _check_dp_size(m: RolloutManager, dp: int) -> None:
    """422 when a step of ``global_batch_size`` samples cannot be split evenly over ``dp`` ranks."""
    gbs = m.cfg.global_batch_size or 0
    multiple, what = step_multiple(m.cfg.micro_batch_size, dp, m.cfg.max_tokens_per_gpu)
    if gbs % multiple:
        raise ServiceError(422, f"dp_size={dp}: global_batch_size={gbs} is not a multiple of {what}")


def _add_engine_routes(app: FastAPI, mgr: Any, auth: list[Any]) -> None:
    @app.get("/v1/engines", response_model=EnginesStatus)
    async def get_engines(request: Request) -> EnginesStatus:
        m: RolloutManager = mgr(request)
        live = m.engines.live()
        versions = await asyncio.gather(*(_reported_version(r) for r in live))
        reported = dict(zip((r.url for r in live), versions, strict=True))
        return engines_status(m, reported)

    @app.post("/v1/engines/offload", response_model=MemoryResult, dependencies=auth)
    async def offload(request: Request, body: OffloadRequest | None = None) -> MemoryResult:
        m: RolloutManager = mgr(request)
        if m.jobs.running is not None:
            raise ServiceError(
                409, f"rollout job {m.jobs.running.job_id} is running: offload after it finishes"
            )
        level = (body.level if body else None) or OFFLOAD_LEVEL
        m.monitor.pause("offload")  # seed step 33: a sleeping engine is not a dead one
        start = time.perf_counter()
        results = await m.engines.offload(level)
        return MemoryResult(
            action="offload", level=level, results=results, seconds=time.perf_counter() - start
        )

    @app.post("/v1/engines/onload", response_model=MemoryResult, dependencies=auth)
    async def onload(body: OnloadRequest, request: Request) -> MemoryResult:
        m: RolloutManager = mgr(request)
        start = time.perf_counter()
        sent, results = await m.engines.onload(list(body.tags) if body.tags is not None else None)
        if not m.engines.asleep:
            m.monitor.resume("offload")
        return MemoryResult(
            action="onload", tags_sent=sent, results=results, seconds=time.perf_counter() - start
        )

    @app.post("/v1/engines/update-lock", response_model=UpdatableEngines, dependencies=auth)
    async def update_lock(body: UpdateLockRequest, request: Request) -> UpdatableEngines:
        m: RolloutManager = mgr(request)
        try:
            lease = m.engines.lock.acquire(body.ttl_s, body.lease_id)
        except LockHeld as exc:
            raise ServiceError(409, str(exc)) from None
        engines = m.engines.updatable()
        return UpdatableEngines(
            lease_id=lease,
            engines=[engine_info(r) for r in engines],
            num_new_engines=sum(r.status is EngineState.NEEDS_WEIGHTS for r in engines),
            weight_version=m.engines.current_version,
        )

    @app.delete("/v1/engines/update-lock/{lease_id}", dependencies=auth)
    async def release_lock(lease_id: str, request: Request) -> dict[str, bool]:
        try:
            return {"released": mgr(request).engines.lock.release(lease_id)}
        except LockHeld as exc:
            raise ServiceError(409, str(exc)) from None

    @app.post("/v1/engines/weights-loaded", response_model=EnginesStatus, dependencies=auth)
    async def weights_loaded(body: WeightsLoadedRequest, request: Request) -> EnginesStatus:
        m: RolloutManager = mgr(request)
        if body.version < m.engines.current_version:
            raise ServiceError(
                409, f"version {body.version} is older than the engines' {m.engines.current_version}"
            )
        try:
            if body.lease_id:
                m.engines.lock.release(body.lease_id)
            await m.engines.weights_loaded(body.version, body.engine_urls)
        except LockHeld as exc:
            raise ServiceError(409, str(exc)) from None
        except KeyError as exc:
            raise ServiceError(404, str(exc.args[0])) from None
        return engines_status(m)


async def _reported_version(rec: EngineRecord) -> str | None:
    """What the engine says it holds; None when it reports nothing (vLLM 0.26) or does not answer."""
    try:
        return await asyncio.wait_for(rec.control.weight_version(), REPORT_TIMEOUT_S)
    except Exception:
        return None


def _add_control_routes(app: FastAPI, mgr: Any, auth: list[Any]) -> None:
    @app.post("/v1/admission/pause", response_model=AdmissionResult, dependencies=auth)
    async def pause(request: Request) -> AdmissionResult:
        a = mgr(request).admission
        return AdmissionResult(was_paused=a.pause(), paused=a.paused)

    @app.post("/v1/admission/resume", response_model=AdmissionResult, dependencies=auth)
    async def resume(body: ResumeAdmissionRequest, request: Request) -> AdmissionResult:
        a = mgr(request).admission
        a.resume(body.was_paused)
        return AdmissionResult(was_paused=body.was_paused, paused=a.paused)

    @app.post("/v1/training-ready", dependencies=auth)
    async def training_ready(request: Request) -> dict[str, Any]:
        """Seed step 9: the trainer's weights are on the engines. Rollouts requested before it are
        never handed to the run; admission that a previous run's last step left paused (it skips
        step 53) opens again, as the seed's recovery resume does."""
        m: RolloutManager = mgr(request)
        m.jobs.new_run()
        a = m.admission
        a.paused = False
        return {"training_ready": True, "admission_paused": a.paused}

    @app.post("/v1/training-completed/{rollout_id}", response_model=TrainingCompleted, dependencies=auth)
    async def training_completed(
        request: Request, rollout_id: int = PathParam(ge=0, le=MAX_ID)
    ) -> TrainingCompleted:
        m: RolloutManager = mgr(request)
        pending = await m.sink.pending_count() if m.sink is not None else 0
        return TrainingCompleted(rollout_id=rollout_id, pending_batches=pending)

    @app.get("/v1/data-source/state", response_model=DataSourceState)
    async def get_state(request: Request) -> DataSourceState:
        return DataSourceState(state=mgr(request).data_state())

    @app.put("/v1/data-source/state", response_model=DataSourceState, dependencies=auth)
    async def put_state(body: DataSourceState, request: Request) -> DataSourceState:
        m: RolloutManager = mgr(request)
        try:
            m.set_data_state(body.state)
        except DataStateError as exc:
            raise ServiceError(exc.status_code, str(exc)) from None
        return DataSourceState(state=m.data_state())
