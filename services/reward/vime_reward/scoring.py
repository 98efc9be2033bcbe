"""Scoring checked jobs: in the worker pool (or, for ``remote``, on the event loop), with metrics.

Every outcome becomes a `RewardResult` with a float reward: the function's, or the configured
``timeout_reward`` / ``error_reward`` with the status saying why. Nothing here raises for a sample
that fails; only requests that cannot be scored at all are refused (by `vime_reward.resolve`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from vime.config import RewardConfig
from vime.service import Metrics, ServiceError
from vime.wire.reward import RewardRequest, RewardResult, RewardStatus
from vime_reward.cache import ResultCache, fingerprint
from vime_reward.functions.base import utf8_safe
from vime_reward.functions.remote import (
    RemoteFailed,
    RemoteOptions,
    RemoteScorer,
    RemoteTimeout,
    arrived_hops,
)
from vime_reward.pool import PoolClosed, TaskResult, WorkerPool
from vime_reward.resolve import Job

log = logging.getLogger("vime_reward.scoring")


class RewardMetrics:
    """The reward service's own Prometheus series (beside the HTTP ones of `vime.service`)."""

    def __init__(self, metrics: Metrics, pool: WorkerPool) -> None:
        self.samples: Counter = metrics.counter(
            "vime_reward_samples_total", "Samples scored, by function and outcome", ("fn", "status")
        )
        self.timeouts: Counter = metrics.counter(
            "vime_reward_timeouts_total", "Samples whose verification hit the timeout", ("fn",)
        )
        self.restarts: Counter = metrics.counter(
            "vime_reward_worker_restarts_total", "Pool workers killed and replaced", ("reason",)
        )
        self.cache_hits: Counter = metrics.counter(
            "vime_reward_cache_hits_total", "Requests answered from the idempotency cache"
        )
        self.seconds: Histogram = metrics.histogram(
            "vime_reward_score_seconds", "Seconds to score one sample, pool queueing included", ("fn",)
        )
        busy = Gauge("vime_reward_pool_busy", "Workers running a task", registry=metrics.registry)
        busy.set_function(lambda: pool.stats()["busy"])
        queued = Gauge("vime_reward_pool_queued", "Tasks waiting for a worker", registry=metrics.registry)
        queued.set_function(lambda: pool.stats()["queued"])

    def record(self, result: RewardResult) -> None:
        self.samples.labels(result.fn, result.status.value).inc()
        if result.status == RewardStatus.TIMEOUT:
            self.timeouts.labels(result.fn).inc()
        self.seconds.labels(result.fn).observe(result.elapsed_s)


class Scorer:
    """Scores jobs; answers repeats of a ``sample_id`` from the `ResultCache`."""

    def __init__(
        self,
        cfg: RewardConfig,
        pool: WorkerPool,
        remote: RemoteScorer,
        metrics: RewardMetrics,
        cache: ResultCache | None = None,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.remote = remote
        self.metrics = metrics
        self.cache = cache or ResultCache()

    async def score(self, job: Job) -> RewardResult:
        """The result of one job (from the cache when its sample id was seen with the same request)."""
        key = job.req.sample_id
        if key is None:
            return await self._compute(job)
        if hops := arrived_hops.get():
            # A sample forwarded back to this service is another computation, not a retry: waiting
            # on the first would wait on itself.
            key = f"{key}@hop{hops}"
        digest = fingerprint(job.target.name, job.options, job.req)
        result, repeated = await self.cache.once(key, digest, lambda: self._compute(job))
        if repeated:
            self.metrics.cache_hits.inc()
            return result.model_copy(update={"cached": True})
        return result

    async def score_many(self, jobs: list[Job], group: bool) -> list[RewardResult]:
        """Results in order; ``group`` with one user function for all items makes one call of it."""
        first = jobs[0].target
        if group and first.builtin is None and all(j.target == first for j in jobs):
            return await self._score_group(jobs)
        return list(await asyncio.gather(*(self.score(j) for j in jobs)))

    async def _score_group(self, jobs: list[Job]) -> list[RewardResult]:
        digests = [fingerprint(j.target.name, j.options, j.req) for j in jobs]
        kept = [
            self.cache.get(j.req.sample_id, d) if j.req.sample_id else None
            for j, d in zip(jobs, digests, strict=True)
        ]
        if all(k is not None for k in kept):
            self.metrics.cache_hits.inc(len(jobs))
            return [k.model_copy(update={"cached": True}) for k in kept if k is not None]
        task = {
            "kind": "score",
            "fn": jobs[0].target.name,
            "items": [j.req.model_dump(mode="json") for j in jobs],
            "group": True,
        }
        try:
            outcome = await self.pool.run(task, self.cfg.timeout_s)
        except PoolClosed as exc:
            raise ServiceError(503, str(exc)) from None
        results = [self._from_task(j, outcome, i) for i, j in enumerate(jobs)]
        for job, digest, result in zip(jobs, digests, results, strict=True):
            self.metrics.record(result)
            if job.req.sample_id:
                self.cache.put(job.req.sample_id, digest, result)
        return results

    async def _compute(self, job: Job) -> RewardResult:
        try:
            if job.target.in_pool:
                outcome = await self.pool.run(self._task(job), self.cfg.timeout_s)
                result = self._from_task(job, outcome, 0)
            else:
                result = await self._remote(job)
        except PoolClosed as exc:
            raise ServiceError(503, str(exc)) from None
        except Exception as exc:  # a bug here must cost one sample, not the batch (and never a 500)
            log.exception("scoring %s failed", job.target.name)
            result = self._failed(job.req, job.target.name, "error", f"internal error: {exc!r}", 0.0)
        self.metrics.record(result)
        return result

    def _task(self, job: Job) -> dict[str, Any]:
        if job.target.builtin is not None:
            item: dict[str, Any] = {"response": job.req.response, "label": job.req.label}
        else:
            item = job.req.model_dump(mode="json")
        return {"kind": "score", "fn": job.target.name, "items": [item], "options": job.options}

    def _from_task(self, job: Job, outcome: TaskResult, index: int) -> RewardResult:
        if outcome.status == "ok":
            found = outcome.reply["results"][index]
            return self._result(job.req, job.target.name, outcome.elapsed_s, **found)
        return self._failed(job.req, job.target.name, outcome.status, outcome.error, outcome.elapsed_s)

    async def _remote(self, job: Job) -> RewardResult:
        opts = job.parsed_options if isinstance(job.parsed_options, RemoteOptions) else RemoteOptions()
        start = time.perf_counter()
        try:
            found = await self.remote.score(job.req, opts)
        except RemoteTimeout as exc:
            return self._failed(job.req, "remote", "timeout", str(exc), time.perf_counter() - start)
        except RemoteFailed as exc:
            return self._failed(job.req, "remote", "error", str(exc), time.perf_counter() - start)
        return self._result(
            job.req, "remote", time.perf_counter() - start, found.reward, found.pred, found.details
        )

    def _result(
        self,
        req: RewardRequest,
        fn: str,
        elapsed_s: float,
        reward: float,
        pred: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> RewardResult:
        return RewardResult(
            reward=reward,
            fn=fn,
            pred=utf8_safe(pred),
            details=utf8_safe(details or {}),
            sample_id=req.sample_id,
            elapsed_s=round(elapsed_s, 6),
        )

    def _failed(
        self, req: RewardRequest, fn: str, status: str, error: str | None, elapsed_s: float
    ) -> RewardResult:
        timed_out = status == "timeout"
        return RewardResult(
            reward=self.cfg.timeout_reward if timed_out else self.cfg.error_reward,
            status=RewardStatus.TIMEOUT if timed_out else RewardStatus.ERROR,
            fn=fn,
            timed_out=timed_out,
            error=utf8_safe(error),
            sample_id=req.sample_id,
            elapsed_s=round(elapsed_s, 6),
        )
