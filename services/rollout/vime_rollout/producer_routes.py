"""The async producer's routes: ``GET /v1/producer``, ``POST /v1/producer/start`` and
``POST /v1/producer/stop`` (`vime_rollout.producer`). Starting is refused (409) by a manager started
for the sync mode, while it already runs, or while a rollout job runs."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from redis.exceptions import RedisError

from vime.service import ServiceError
from vime.wire.rollout import ProducerRequest, ProducerStatus
from vime_rollout.manager import RolloutManager


def add_producer_routes(app: FastAPI, mgr: Any, auth: list[Any], check_dp_size: Any) -> None:
    async def status(m: RolloutManager) -> ProducerStatus:
        try:
            waiting = await m.producer.waiting()
        except RedisError as exc:
            raise ServiceError(503, f"Redis: {type(exc).__name__}: {exc}") from None
        return m.producer.status(waiting)

    @app.get("/v1/producer", response_model=ProducerStatus)
    async def get_producer(request: Request) -> ProducerStatus:
        return await status(mgr(request))

    @app.post("/v1/producer/start", response_model=ProducerStatus, dependencies=auth)
    async def start_producer(body: ProducerRequest, request: Request) -> ProducerStatus:
        m: RolloutManager = mgr(request)
        if m.cfg.mode != "async":
            raise ServiceError(
                409,
                f"the rollout manager was started with mode={m.cfg.mode}: the producer is the async mode's",
            )
        if m.producer.running:
            raise ServiceError(409, "the async producer is running already: POST /v1/producer/stop first")
        if m.jobs.running is not None:
            raise ServiceError(
                409, f"rollout job {m.jobs.running.job_id} is running: start after it finishes"
            )
        if m.sink is None:
            raise ServiceError(503, "no Redis configured: batches cannot be published")
        check_dp_size(m, body.dp_size)
        m.check_can_roll_out(evaluation=True)  # engines awake and serving; admission gates each rollout
        m.producer.start(body.first_rollout_id, body.end_rollout_id, body.dp_size, body.max_staleness)
        return await status(m)

    @app.post("/v1/producer/stop", response_model=ProducerStatus, dependencies=auth)
    async def stop_producer(request: Request) -> ProducerStatus:
        """Cancels the rollout under way (its prompts go back to the data source); idempotent."""
        m: RolloutManager = mgr(request)
        await m.producer.stop()
        return await status(m)
