"""Scoring checked jobs: in the worker pool (or, for ``remote``, on the event loop), with metrics.

Every outcome becomes a `RewardResult` with a float reward: the function's, or the configured
``timeout_reward`` / ``error_reward`` with the status saying why. Nothing here raises for a sample
that fails; only requests that cannot be scored at all are refused (by `vime_reward.resolve`).

A batch (not a group) is scored in chunks: its pool jobs that the cache does not answer (no
``sample_id``, or one neither kept nor running) are cut, per function and options, into chunks
that shrink as the work left does (`chunk_sizes`), and each chunk is one streamed pool task
(`WorkerPool.run_stream`) whose items are still scored, timed out and failed one by one. Items a
chunk never ran (after one that overran its deadline or killed its worker) are scored again one
by one. A chunk of jobs with sample ids runs as a task of its own, as one such job's
computation does, and its results are kept in the cache; remote jobs are scored one by one.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
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

CHUNK_ITEMS = 32
"""The most items of one streamed pool task."""
CHUNKS_PER_WORKER = 2
"""A chunk takes at most 1 / (workers × this) of the items left (see `chunk_sizes`)."""


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
        self._filling: set[asyncio.Task[None]] = set()

    async def score(self, job: Job) -> RewardResult:
        """The result of one job (from the cache when its sample id was seen with the same request)."""
        return await self._start(job, lambda: self._compute(job))

    async def score_many(self, jobs: list[Job], group: bool) -> list[RewardResult]:
        """Results in order; ``group`` with one user function for all items makes one call of it;
        else pool jobs the cache cannot answer are scored in chunks (see the module docstring)."""
        first = jobs[0].target
        if group and first.builtin is None and all(j.target == first for j in jobs):
            return await self._score_group(jobs)
        loop = asyncio.get_running_loop()
        slots: dict[int, asyncio.Future[RewardResult]] = {}

        def slot(i: int) -> asyncio.Future[RewardResult]:
            slots[i] = loop.create_future()
            return slots[i]

        waits = [
            self._start(job, functools.partial(slot, i)) if job.target.in_pool else self.score(job)
            for i, job in enumerate(jobs)
        ]
        fills: list[tuple[asyncio.Task[None], bool]] = []
        for chunk in self._chunks(jobs, list(slots)):
            fill = loop.create_task(self._fill([jobs[i] for i in chunk], [slots[i] for i in chunk]))
            self._filling.add(fill)
            fill.add_done_callback(self._filling.discard)
            fills.append((fill, jobs[chunk[0]].req.sample_id is None))
        try:
            return list(await asyncio.gather(*waits))
        except asyncio.CancelledError:
            # As for one job: a computation the cache shares goes on; the others stop.
            for fill, uncached in fills:
                if uncached:
                    fill.cancel()
            raise

    def _start(self, job: Job, compute: Callable[[], Awaitable[RewardResult]]) -> Awaitable[RewardResult]:
        """What answers ``job``: ``compute()``, or for a sample id the cache's answer, or its running
        computation, or else ``compute()`` started as a task of its own (kept when done)."""
        key = job.req.sample_id
        if key is None:
            return compute()
        if hops := arrived_hops.get():
            # A sample forwarded back to this service is another computation, not a retry: waiting
            # on the first would wait on itself.
            key = f"{key}@hop{hops}"
        digest = fingerprint(job.target.name, job.options, job.req)
        waiting, repeated = self.cache.begin(key, digest, compute)
        return self._repeat(waiting) if repeated else waiting

    async def _repeat(self, waiting: Awaitable[RewardResult]) -> RewardResult:
        result = await waiting
        self.metrics.cache_hits.inc()
        return result.model_copy(update={"cached": True})

    def _chunks(self, jobs: list[Job], indices: list[int]) -> list[list[int]]:
        """``indices`` of pool jobs by function, options and whether the cache shares them, each kind
        cut into chunks that shrink as the work left does (see `chunk_sizes`), neighbours (one
        prompt's samples) dealt into different chunks."""
        alike: dict[tuple[str, str, bool], list[int]] = {}
        for i in indices:
            alike.setdefault((*_chunk_key(jobs[i]), jobs[i].req.sample_id is None), []).append(i)
        chunks: list[list[int]] = []
        for same in alike.values():
            sizes = chunk_sizes(len(same), self.pool.size)
            dealt = [i for k in range(len(sizes)) for i in same[k :: len(sizes)]]
            start = 0
            for size in sizes:
                chunks.append(dealt[start : start + size])
                start += size
        return chunks

    async def _fill(self, jobs: list[Job], slots: list[asyncio.Future[RewardResult]]) -> None:
        """Answer each slot with its job's result (an exception: on every slot)."""
        try:
            results = await self._score_chunk(jobs)
        except asyncio.CancelledError:
            for waiting in slots:
                waiting.cancel()
            raise
        except Exception as exc:  # the pool closed (503): every waiter gets it, as from `score`
            for waiting in slots:
                if not waiting.done():
                    waiting.set_exception(exc)
            return
        for waiting, result in zip(slots, results, strict=True):
            if not waiting.done():  # its caller may have gone
                waiting.set_result(result)

    async def _score_chunk(self, jobs: list[Job]) -> list[RewardResult]:
        """Jobs of one function and options as one streamed pool task; whatever it did not run, one
        by one."""
        if len(jobs) == 1:
            return [await self._compute(jobs[0])]
        task = {
            "kind": "score",
            "fn": jobs[0].target.name,
            "items": [self._item(j) for j in jobs],
            "options": jobs[0].options,
        }
        try:
            outcomes = await self.pool.run_stream(task, self.cfg.timeout_s)
        except PoolClosed as exc:
            raise ServiceError(503, str(exc)) from None
        except Exception as exc:  # as in _compute: a bug here must cost these samples, not the batch
            log.exception("scoring %s failed", jobs[0].target.name)
            error = f"internal error: {exc!r}"
            outcomes = [TaskResult("error", error=error) for _ in jobs]
        done: dict[int, RewardResult] = {}
        for i, (job, outcome) in enumerate(zip(jobs, outcomes, strict=True)):
            if outcome is not None:
                done[i] = self._from_task(job, outcome, 0)
                self.metrics.record(done[i])
        rerun = [i for i in range(len(jobs)) if i not in done]
        again = await asyncio.gather(*(self._compute(jobs[i]) for i in rerun))
        done.update(zip(rerun, again, strict=True))
        return [done[i] for i in range(len(jobs))]

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
        return {"kind": "score", "fn": job.target.name, "items": [self._item(job)], "options": job.options}

    def _item(self, job: Job) -> dict[str, Any]:
        if job.target.builtin is not None:
            return {"response": job.req.response, "label": job.req.label}
        return job.req.model_dump(mode="json")

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


def chunk_sizes(count: int, workers: int) -> list[int]:
    """Chunk sizes for ``count`` items on ``workers``: each a share of what is left (at most
    `CHUNK_ITEMS`), so the last chunks are small and no worker is left with a long one while the
    others idle (the pool hands chunks out in this order)."""
    sizes: list[int] = []
    while count > 0:
        size = min(CHUNK_ITEMS, max(1, math.ceil(count / (workers * CHUNKS_PER_WORKER))))
        sizes.append(size)
        count -= size
    return sizes


def _chunk_key(job: Job) -> tuple[str, str]:
    """Jobs that may share a streamed task: one function, one set of options (a user function's
    options travel in its items)."""
    options = json.dumps(job.options, sort_keys=True) if job.target.builtin is not None else ""
    return job.target.name, options
