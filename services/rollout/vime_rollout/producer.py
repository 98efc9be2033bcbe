"""The async mode's producer (the seed's ``fully_async`` consumer of step 44): rollout after rollout
published to Redis while the trainer trains.

The trainer starts it with the first and the end rollout id, its DP size and ``max_staleness``.
Before each rollout it waits until fewer than ``max_staleness`` batches wait untaken in Redis
(`vime.queue_waiting`) and admission is open: the trainer pauses admission around each push (step
44 with ``drain=False``: requests in flight go on, no new group starts). A rollout is the sync
mode's (`RolloutManager.run_training`): the same loop, batch builder and publish; one that fails
restores the data source's position and stops the producer with the error. Stopping cancels the
rollout under way, which restores its position too, so what was published is exactly what the data
source has handed out. ``generating_s`` counts the seconds a rollout was under way, for the
trainer to measure how much generation overlapped its training.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from vime.queue_waiting import waiting_entries
from vime.wire.rollout import PRODUCER_NEXT_KEY, ProducerStatus, RolloutJob

if TYPE_CHECKING:
    from vime_rollout.manager import RolloutManager

log = logging.getLogger("vime.rollout.producer")

GATE_POLL_S = 0.1
"""How often a producer with no room asks Redis again (the trainer takes a batch, or drops one)."""


class Producer:
    """One background task producing rollouts ``[first, end)`` for the trainer."""

    def __init__(self, manager: RolloutManager) -> None:
        self.manager = manager
        self.task: asyncio.Task[None] | None = None
        self.next_rollout_id: int | None = None
        self.end_rollout_id: int | None = None
        self.max_staleness = 1
        self.published = 0
        self.error: str | None = None
        self._generated_s = 0.0
        self._since: float | None = None
        self.published_state: dict[str, Any] | None = None
        """The data source's position after the last published batch, with the next rollout id
        (what a checkpoint saves); None until started, and again once a position is restored."""

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    @property
    def generating_s(self) -> float:
        """Seconds rollouts have been under way since the producer was made."""
        extra = time.monotonic() - self._since if self._since is not None else 0.0
        return self._generated_s + extra

    def start(self, first: int, end: int, dp_size: int, max_staleness: int) -> None:
        self.next_rollout_id, self.end_rollout_id = first, end
        self.max_staleness, self.published, self.error = max_staleness, 0, None
        self.published_state = {**self.manager.data.state_dict(), PRODUCER_NEXT_KEY: first}
        self.task = asyncio.create_task(self._run(dp_size), name="async-producer")

    async def stop(self) -> None:
        """Cancel the rollout under way (its prompts go back) and wait until the task has ended."""
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    def status(self, waiting: int) -> ProducerStatus:
        return ProducerStatus(
            running=self.running,
            run_id=self.manager.run_id,
            next_rollout_id=self.next_rollout_id,
            end_rollout_id=self.end_rollout_id,
            max_staleness=self.max_staleness,
            published=self.published,
            waiting=waiting,
            generating=self._since is not None,
            generating_s=self.generating_s,
            error=self.error,
        )

    async def waiting(self) -> int:
        sink = self.manager.sink
        return 0 if sink is None else len(await waiting_entries(sink.redis, sink.run_id))

    async def _run(self, dp_size: int) -> None:
        try:
            while self.next_rollout_id is not None and self.next_rollout_id < (self.end_rollout_id or 0):
                await self._room()
                await self._one(self.next_rollout_id, dp_size)
        except asyncio.CancelledError:
            log.info("producer stopped before rollout %s", self.next_rollout_id)
            raise
        except Exception as exc:
            self.error = f"rollout {self.next_rollout_id}: {type(exc).__name__}: {exc}"
            log.error("async producer stopped: %s", self.error)

    async def _room(self) -> None:
        """Until admission is open and fewer than ``max_staleness`` batches wait untaken."""
        while True:
            await self.manager.admission.wait_open()
            if await self.waiting() < self.max_staleness:
                return
            await asyncio.sleep(GATE_POLL_S)

    async def _one(self, rollout_id: int, dp_size: int) -> None:
        job = RolloutJob(
            job_id=uuid.uuid4().hex[:12],
            rollout_id=rollout_id,
            run_id=self.manager.run_id,
            created_at=time.time(),
        )
        self._since = time.monotonic()
        try:
            await self.manager.run_training(job, dp_size)
        finally:
            assert self._since is not None
            self._generated_s += time.monotonic() - self._since
            self._since = None
        self.published += 1
        self.next_rollout_id = rollout_id + 1
        self.published_state = {**self.manager.data.state_dict(), PRODUCER_NEXT_KEY: rollout_id + 1}
