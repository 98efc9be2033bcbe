"""Typed async client of the rollout manager (used by the trainer's run controller).

One method per route. State-changing calls carry the bearer token; a blocking rollout gets no
read timeout by default (a 256-sample rollout of 1024-token responses takes minutes). Calls that
are safe to repeat are marked idempotent, so a lost reply is answered by sending them again
(`vime.clients.base`); ``update_lock`` is made so by naming its lease itself.
"""

from __future__ import annotations

import uuid
from typing import Any

from vime.clients.base import ServiceClient
from vime.retry import poll_until
from vime.wire.rollout import (
    AdmissionResult,
    DataSourceState,
    EnginesStatus,
    JobState,
    MemoryResult,
    ProducerStatus,
    RolloutJob,
    SftBatch,
    TrainingCompleted,
    UpdatableEngines,
)


class RolloutClient(ServiceClient):
    """``await client.rollout(0)`` → the finished `RolloutJob` with its batch id and metrics."""

    def __init__(self, base_url: str, *, timeout: float | None = 120.0, **kwargs: Any) -> None:
        super().__init__(base_url, timeout=timeout, **kwargs)

    async def rollout(
        self,
        rollout_id: int,
        *,
        evaluation: bool = False,
        wait: bool = True,
        dp_size: int | None = None,
        publish: bool = True,
    ) -> RolloutJob:
        """Start rollout ``rollout_id``; with ``wait`` block until it is done (no read timeout).

        A retried call for a rollout that is running or done returns the same job, so a dropped
        connection does not generate the rollout twice. ``publish=False``: the samples come back in
        the job (``job.samples``), nothing is published for a trainer, and every call rolls out anew.
        """
        body: dict[str, Any] = {"rollout_id": rollout_id, "evaluation": evaluation, "wait": wait}
        if dp_size is not None:
            body["dp_size"] = dp_size
        if not publish:
            body["publish"] = False
        out = await self.request(
            "POST", "/v1/rollouts", json=body, timeout=None if wait else ..., expect=(200, 202)
        )
        return RolloutJob.model_validate(out)

    async def sft_batch(self, step: int, *, dp_size: int | None = None) -> SftBatch:
        """Publish supervised warm-up step ``step``'s batch; the reply says where to read it.

        Safe to retry: the step fixes the examples, and a trainer reading the step skips an
        earlier attempt's batch.
        """
        body: dict[str, Any] = {"step": step}
        if dp_size is not None:
            body["dp_size"] = dp_size
        out = await self.request("POST", "/v1/sft-batches", json=body, idempotent=True)
        return SftBatch.model_validate(out)

    async def job(self, job_id: str) -> RolloutJob:
        return RolloutJob.model_validate(await self.request("GET", f"/v1/rollouts/{job_id}", idempotent=True))

    async def wait_job(self, job_id: str, poll_s: float = 1.0, timeout_s: float | None = None) -> RolloutJob:
        """Poll a job until it is no longer running."""

        async def finished() -> RolloutJob | None:
            job = await self.job(job_id)
            return job if job.state is not JobState.RUNNING else None

        return await poll_until(
            finished, timeout_s=timeout_s, interval_s=poll_s, what=f"rollout job {job_id}"
        )

    async def engines(self) -> EnginesStatus:
        return EnginesStatus.model_validate(await self.request("GET", "/v1/engines", idempotent=True))

    async def offload(self, level: int | None = None) -> MemoryResult:
        """Seed steps 33–36: every engine sleeps (level 2 when it receives weight updates)."""
        out = await self.request(
            "POST", "/v1/engines/offload", json={"level": level}, timeout=None, idempotent=True
        )
        return MemoryResult.model_validate(out)

    async def onload(self, tags: list[str] | None = None) -> MemoryResult:
        """Seed steps 4–7 (``["weights"]``) and 10–13 (``["kv_cache", "cuda_graph"]``)."""
        out = await self.request(
            "POST", "/v1/engines/onload", json={"tags": tags}, timeout=None, idempotent=True
        )
        return MemoryResult.model_validate(out)

    async def update_lock(self, ttl_s: float = 600.0) -> UpdatableEngines:
        """The engines a weight push must reach, under a lease (seed: get_updatable_engines_and_lock).

        The lease id is chosen here and sent with the request, so a request sent again after a
        lost reply gets its own lease back instead of a 409 from it."""
        body = {"ttl_s": ttl_s, "lease_id": uuid.uuid4().hex[:16]}
        out = await self.request("POST", "/v1/engines/update-lock", json=body, idempotent=True)
        return UpdatableEngines.model_validate(out)

    async def release_update_lock(self, lease_id: str) -> None:
        await self.request(
            "DELETE", f"/v1/engines/update-lock/{lease_id}", expect=(200, 204), idempotent=True
        )

    async def weights_loaded(
        self, version: int, *, lease_id: str | None = None, engine_urls: list[str] | None = None
    ) -> EnginesStatus:
        """Report a finished push of ``version`` (releases the lease; waiting engines serve again)."""
        body = {"version": version, "lease_id": lease_id, "engine_urls": engine_urls}
        return EnginesStatus.model_validate(
            await self.request("POST", "/v1/engines/weights-loaded", json=body, idempotent=True)
        )

    async def pause_admission(self) -> AdmissionResult:
        return AdmissionResult.model_validate(
            await self.request("POST", "/v1/admission/pause", idempotent=True)
        )

    async def resume_admission(self, was_paused: bool) -> AdmissionResult:
        out = await self.request(
            "POST", "/v1/admission/resume", json={"was_paused": was_paused}, idempotent=True
        )
        return AdmissionResult.model_validate(out)

    async def training_ready(self) -> dict[str, Any]:
        return dict(await self.request("POST", "/v1/training-ready", idempotent=True))

    async def training_completed(self, rollout_id: int) -> TrainingCompleted:
        out = await self.request("POST", f"/v1/training-completed/{rollout_id}")
        return TrainingCompleted.model_validate(out)

    async def data_state(self) -> dict[str, Any]:
        """The data source's position, to save with a checkpoint."""
        out = await self.request("GET", "/v1/data-source/state", idempotent=True)
        return DataSourceState.model_validate(out).state

    async def set_data_state(self, state: dict[str, Any]) -> None:
        """Restore a saved position (a resumed run continues with the prompts it had not seen)."""
        await self.request("PUT", "/v1/data-source/state", json={"state": state}, idempotent=True)

    async def producer(self) -> ProducerStatus:
        """The async mode's producer: running, next rollout, batches waiting, seconds generating."""
        return ProducerStatus.model_validate(await self.request("GET", "/v1/producer", idempotent=True))

    async def start_producer(
        self, first_rollout_id: int, end_rollout_id: int, *, dp_size: int, max_staleness: int
    ) -> ProducerStatus:
        body = {
            "first_rollout_id": first_rollout_id,
            "end_rollout_id": end_rollout_id,
            "dp_size": dp_size,
            "max_staleness": max_staleness,
        }
        return ProducerStatus.model_validate(await self.request("POST", "/v1/producer/start", json=body))

    async def stop_producer(self) -> ProducerStatus:
        """Stop it; the rollout under way is cancelled and its prompts go back to the data source."""
        out = await self.request("POST", "/v1/producer/stop", timeout=None, idempotent=True)
        return ProducerStatus.model_validate(out)

    async def health(self) -> dict[str, Any]:
        return dict(await self.request("GET", "/health", idempotent=True))
