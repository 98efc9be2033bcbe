"""Typed async client of the trainer service (used by the `vime` CLI and the tests).

One method per route. State-changing calls carry the bearer token; `wait_run` polls a run until
it leaves the running states.
"""

from __future__ import annotations

from typing import Any

from vime.clients.base import ServiceClient
from vime.retry import poll_until
from vime.wire.trainer import (
    ACTIVE_STATES,
    Accepted,
    CheckpointResult,
    PushResult,
    RunEvents,
    RunList,
    RunStatus,
)


class TrainerClient(ServiceClient):
    """``await client.start_run({"num_rollout": 3})`` → the new run's `RunStatus`."""

    async def start_run(
        self, config: dict[str, Any] | None = None, *, run_id: str | None = None, resume: bool = False
    ) -> RunStatus:
        """Start a run (409 while another one is active); ``config`` overrides the service's config;
        ``resume``: continue ``run_id`` after its newest checkpoint (409 when it has none)."""
        body: dict[str, Any] = {"config": config or {}}
        if run_id is not None:
            body["run_id"] = run_id
        if resume:
            body["resume"] = True
        out = await self.request("POST", "/v1/runs", json=body, expect=(201,))
        return RunStatus.model_validate(out)

    async def run(self, run_id: str) -> RunStatus:
        return RunStatus.model_validate(await self.request("GET", f"/v1/runs/{run_id}", idempotent=True))

    async def runs(self) -> RunList:
        return RunList.model_validate(await self.request("GET", "/v1/runs", idempotent=True))

    async def events(self, run_id: str, since: int = 0) -> RunEvents:
        out = await self.request("GET", f"/v1/runs/{run_id}/events", params={"since": since}, idempotent=True)
        return RunEvents.model_validate(out)

    async def stop(self, run_id: str) -> RunStatus:
        """Ask the run to finish its current step, checkpoint and stop (returns at once)."""
        out = await self.request("POST", f"/v1/runs/{run_id}/stop", expect=(202,))
        return RunStatus.model_validate(out)

    async def wait_run(
        self, run_id: str, *, timeout_s: float | None = None, poll_s: float = 1.0
    ) -> RunStatus:
        """Poll until the run is finished, stopped or failed (TimeoutError after ``timeout_s``)."""

        async def ended() -> RunStatus | None:
            status = await self.run(run_id)
            return status if status.state not in ACTIVE_STATES else None

        return await poll_until(ended, timeout_s=timeout_s, interval_s=poll_s, what=f"run {run_id} ended")

    async def push_weights(self, *, wait: bool = True) -> PushResult | Accepted:
        """Push the active run's weights at its next step boundary (version + 1)."""
        out = await self.request(
            "POST", "/v1/weights/push", json={"wait": wait}, timeout=None if wait else ..., expect=(200, 202)
        )
        return PushResult.model_validate(out) if wait else Accepted.model_validate(out)

    async def checkpoint(self, *, wait: bool = True) -> CheckpointResult | Accepted:
        """Checkpoint the active run after its current step's training."""
        out = await self.request(
            "POST", "/v1/checkpoints", json={"wait": wait}, timeout=None if wait else ..., expect=(200, 202)
        )
        return CheckpointResult.model_validate(out) if wait else Accepted.model_validate(out)

    async def health(self) -> dict[str, Any]:
        return dict(await self.request("GET", "/health", idempotent=True))
