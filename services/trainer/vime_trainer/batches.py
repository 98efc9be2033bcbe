"""Reading a rollout's batch from Redis for every DP rank, and acking it after training (seed 37, 42).

One `BatchConsumer` per DP rank with a stable name, so a restarted trainer first gets back what
it had read but not acked. The rollout manager publishes on the stream of *its* run id, which
its reply carries (`RolloutJob.run_id`), so the trainer follows it even when its own run id
(which names records and checkpoints) differs. A batch of an earlier rollout still pending (a
rollout retried after a crash published it twice) is acked and skipped.
"""

from __future__ import annotations

import asyncio
import time

from vime.batch import RankBatch
from vime.queue import BatchConsumer


class BatchReadError(RuntimeError):
    """The batch a rollout reported never arrived, or something else did."""


class BatchReader:
    """The trainer's DP ranks' consumers, opened on first use for the stream a batch came from."""

    def __init__(self, redis_url: str, dp_size: int, name_prefix: str = "trainer") -> None:
        self.redis_url = redis_url
        self.dp_size = dp_size
        self.name_prefix = name_prefix
        self._stream: str | None = None
        self._consumers: list[BatchConsumer] = []

    async def _open(self, stream: str) -> list[BatchConsumer]:
        """The consumers of ``stream`` (the ones of another stream are closed first)."""
        if stream != self._stream:
            await self.aclose()
            self._consumers = [
                BatchConsumer(self.redis_url, stream, d, f"{self.name_prefix}-rank{d}")
                for d in range(self.dp_size)
            ]
            self._stream = stream
        return self._consumers

    async def read(
        self, run_id: str, batch_id: str, rollout_id: int, timeout_s: float = 120.0
    ) -> list[RankBatch]:
        """Every DP rank's share of ``batch_id`` from run ``run_id``'s stream, in DP-rank order."""
        if not run_id or not batch_id:
            raise BatchReadError(f"no batch to read: run id {run_id!r}, batch id {batch_id!r}")
        consumers = await self._open(run_id)
        return list(
            await asyncio.gather(*(self._read_one(c, batch_id, rollout_id, timeout_s) for c in consumers))
        )

    async def _read_one(
        self, consumer: BatchConsumer, batch_id: str, rollout_id: int, timeout_s: float
    ) -> RankBatch:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            share = await consumer.next(block_ms=max(1, int(min(left, 5.0) * 1000)))
            if share is None:
                continue
            if share.batch_id == batch_id:
                return share
            if share.rollout_id <= rollout_id:  # an earlier attempt or rollout left pending: done with it
                await consumer.ack(share.batch_id)
                continue
            raise BatchReadError(
                f"rank {consumer.dp_rank}: expected batch {batch_id} of rollout {rollout_id}, "
                f"got {share.batch_id} of rollout {share.rollout_id}"
            )
        raise BatchReadError(
            f"rank {consumer.dp_rank}: batch {batch_id} did not arrive within {timeout_s:.0f}s"
        )

    async def ack(self, batch_id: str) -> None:
        """After the optimizer step: every rank's share is trained (Redis frees the blobs)."""
        await asyncio.gather(*(c.ack(batch_id) for c in self._consumers))

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._consumers), return_exceptions=True)
        self._consumers, self._stream = [], None
