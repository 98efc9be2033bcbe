"""The reward service's HTTP API (seed step 26).

``POST /v1/reward`` scores one sample, ``POST /v1/rewards`` a batch or a GRPO group,
``GET /v1/reward-functions`` lists what each function expects; ``/health`` adds the pool's state
and ``/metrics`` the reward series. Requests that cannot be scored are refused before any work:
400 for an unknown function, 422 for a missing label / bad options, 413 for an oversized body.
A sample whose function fails or times out still gets a reward (with its status), never a 500.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request

from vime.config import RunConfig
from vime.service import ServiceError, create_app
from vime.wire.reward import (
    RewardBatchRequest,
    RewardBatchResult,
    RewardFunctionInfo,
    RewardFunctionList,
    RewardRequest,
    RewardResult,
)
from vime_reward.functions import BUILTINS
from vime_reward.functions.remote import HOPS_HEADER, RemoteScorer, arrived_hops, hops_of
from vime_reward.pool import WorkerPool
from vime_reward.resolve import Resolver
from vime_reward.scoring import RewardMetrics, Scorer


def _authorized(request: Request, token: str | None) -> bool:
    if not token:
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip(), token)


def function_list(default: str) -> RewardFunctionList:
    """The built-in functions with their options' JSON schemas."""
    return RewardFunctionList(
        default=default,
        functions=[
            RewardFunctionInfo(
                name=f.name,
                description=f.description,
                label=f.label,
                options=f.options.model_json_schema(),
                needs_label=f.needs_label,
                needs_text=f.needs_text,
            )
            for f in BUILTINS.values()
        ],
    )


def build_app(cfg: RunConfig, *, token: str | None) -> FastAPI:
    """The reward service app for ``cfg`` (its ``reward`` section), guarded by ``token``."""
    rcfg = cfg.reward
    pool = WorkerPool(rcfg.num_workers, memory_limit_mb=rcfg.worker_memory_mb)
    remote = RemoteScorer(rcfg.remote_url, rcfg.timeout_s)
    resolver = Resolver(rcfg, pool)
    holder: dict[str, Scorer] = {}
    listing = function_list(resolver.default_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = RewardMetrics(app.state.metrics, pool)
        pool.on_restart = lambda reason: metrics.restarts.labels(reason).inc()
        await pool.start()
        holder["scorer"] = Scorer(rcfg, pool, remote, metrics)
        try:
            yield
        finally:
            await remote.aclose()
            await pool.close()

    async def health() -> dict[str, Any]:
        if "scorer" not in holder:
            raise ServiceError(503, "the reward worker pool is starting")
        return {"pool": pool.stats(), "default_fn": resolver.default_name}

    app = create_app("reward", max_body_bytes=rcfg.max_body_bytes, health=health, lifespan=lifespan)

    @app.post("/v1/reward", response_model=RewardResult)
    async def reward(body: RewardRequest, request: Request) -> RewardResult:
        """Score one sample."""
        arrived_hops.set(hops_of(request.headers.get(HOPS_HEADER)))
        job = await resolver.job(body, authorized=_authorized(request, token))
        return await holder["scorer"].score(job)

    @app.post("/v1/rewards", response_model=RewardBatchResult)
    async def rewards(body: RewardBatchRequest, request: Request) -> RewardBatchResult:
        """Score a batch (or, with ``group``, a GRPO group) in request order."""
        arrived_hops.set(hops_of(request.headers.get(HOPS_HEADER)))
        allowed = _authorized(request, token)
        jobs = []
        for i, item in enumerate(body.items):
            if body.options:
                item = item.model_copy(update={"options": {**body.options, **item.options}})
            jobs.append(await resolver.job(item, authorized=allowed, where=f"items.{i}.", batch_fn=body.fn))
        return RewardBatchResult(results=await holder["scorer"].score_many(jobs, body.group))

    @app.get("/v1/reward-functions", response_model=RewardFunctionList)
    async def reward_functions() -> RewardFunctionList:
        """The built-in reward functions, their labels and options, and the default."""
        return listing

    return app
