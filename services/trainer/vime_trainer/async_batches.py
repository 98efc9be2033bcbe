"""The async mode's choice of the batch to train (`AsyncController`), from the batches the producer
published and no rank has taken yet (`vime.queue_waiting`).

A batch's staleness is the trainer's weight version minus the oldest version any of its tokens was
sampled with. The trainer trains the newest waiting batch whose staleness is at most
``max_staleness``; every other waiting batch is dropped: recorded in the run's dropped set before
the ranks read, so no rank ever trains it (each acks it on its way to the chosen one), and counted.
With the producer starting a rollout only while fewer than ``max_staleness`` batches wait, the
chosen one is, in the steady state, the only one waiting; drops come from batches that outlived
more pushes than the bound, or that were waiting when a run (re)started (`drop_leftovers`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vime.clients.rollout import RolloutClient
from vime.queue import connect
from vime.queue_waiting import StreamEntry, drop, waiting_entries

POLL_S = 0.1
"""How often the trainer looks at Redis while it waits for a batch."""
PRODUCER_CHECK_S = 2.0
"""How often, while waiting, it asks whether the producer still runs."""


class ProducerStopped(RuntimeError):
    """The producer ended (a rollout failed, or it was stopped) while the trainer waited on it."""


@dataclass(frozen=True)
class Pick:
    """The batch to train and what was dropped to get to it."""

    entry: StreamEntry
    staleness: int
    waiting: int
    """Batches waiting when it was chosen (it included)."""
    dropped: list[StreamEntry] = field(default_factory=list)


def choose(
    entries: Sequence[StreamEntry], version: int, max_staleness: int
) -> tuple[StreamEntry | None, list[StreamEntry]]:
    """The newest entry at most ``max_staleness`` versions behind ``version``, and every other one
    (all of them when none is fresh enough), oldest first."""
    fresh = [e for e in entries if version - e.weight_version_min <= max_staleness]
    chosen = fresh[-1] if fresh else None
    return chosen, [e for e in entries if e is not chosen]


class AsyncBatches:
    """The trainer's reader of the waiting batches on the rollout manager's stream ``run_id``."""

    def __init__(self, redis_url: str, run_id: str, rollout: RolloutClient, max_staleness: int) -> None:
        self.run_id = run_id
        self.rollout = rollout
        self.max_staleness = max_staleness
        self._r = connect(redis_url)
        self.dropped_total = 0

    async def drop_leftovers(self, keep: Callable[[StreamEntry], bool]) -> list[StreamEntry]:
        """At (re)start: drop the waiting batches this run will not train (``keep`` says which stay)."""
        gone = [e for e in await waiting_entries(self._r, self.run_id) if not keep(e)]
        await self._drop(gone)
        return gone

    async def next(self, version: int, stopping: Callable[[], bool]) -> Pick | None:
        """The batch to train at trainer version ``version``, waiting for one as long as it takes;
        None once a stop is asked. Raises `ProducerStopped` when nothing will come."""
        dropped: list[StreamEntry] = []
        checked = time.monotonic()
        while not stopping():
            entries = await waiting_entries(self._r, self.run_id)
            chosen, others = choose(entries, version, self.max_staleness)
            await self._drop(others)
            dropped += others
            if chosen is not None:
                return Pick(chosen, version - chosen.weight_version_min, len(entries), dropped)
            if time.monotonic() - checked > PRODUCER_CHECK_S:
                checked = time.monotonic()
                await self._check_producer()
            await asyncio.sleep(POLL_S)
        return None

    async def _check_producer(self) -> None:
        status = await self.rollout.producer()
        if status.error:
            raise ProducerStopped(f"the async producer stopped: {status.error}")
        if not status.running and not await waiting_entries(self._r, self.run_id):
            raise ProducerStopped(
                f"the async producer is not running (next rollout {status.next_rollout_id}) and no batch waits"
            )

    async def _drop(self, entries: Sequence[StreamEntry]) -> None:
        await drop(self._r, self.run_id, [e.batch_id for e in entries])
        self.dropped_total += len(entries)

    async def aclose(self) -> None:
        await self._r.aclose()
