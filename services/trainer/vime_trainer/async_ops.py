"""The async mode's own actions (`AsyncController` strings them together with `RunOps`'): start and
stop the rollout manager's producer, wait for the batch to train, train it while measuring how much
generation ran meanwhile. Each is logged in the run's event log."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from vime.queue_waiting import StreamEntry
from vime.wire.rollout import PRODUCER_NEXT_KEY, ProducerStatus
from vime_trainer.async_batches import AsyncBatches, Pick
from vime_trainer.batches import BatchRef
from vime_trainer.ops import RunOps, batch_metrics, train_metrics

log = logging.getLogger("vime.trainer.run")


class AsyncOps:
    """What the async loop does beyond `RunOps`."""

    def __init__(self, ops: RunOps) -> None:
        self.ops, self.ctx, self.cfg = ops, ops.ctx, ops.cfg
        self.batches: AsyncBatches | None = None
        self.stream = ""
        """The rollout manager's run id: the stream its producer publishes on."""

    async def start_producer(self, first: int, resumed: dict[str, Any] | None) -> None:
        """Drop what this run will not train, then start the producer: after the batches a resumed
        checkpoint had seen published (they wait for training), else at ``first``."""
        saved = (resumed or {}).get("data_state") or {}
        producer_first = int(saved.get(PRODUCER_NEXT_KEY, first))
        self.stream = (await self.producer()).run_id
        self.batches = AsyncBatches(self.ops.redis_url, self.stream, self.ops.rollout, self.cfg.max_staleness)
        gone = await self.batches.drop_leftovers(lambda e: first <= e.rollout_id < producer_first)
        if gone:
            self.ctx.events.record(
                "async.dropped", batches=[e.batch_id for e in gone], reason="before this run"
            )
        await self.ops.rollout.start_producer(
            producer_first,
            self.cfg.num_rollout,
            dp_size=self.ops.backend.dp_size,
            max_staleness=self.cfg.max_staleness,
        )
        self.ctx.events.record("producer.start", first=producer_first, end=self.cfg.num_rollout)

    async def stop_producer(self, quiet: bool = False) -> None:
        """Stop it (its rollout under way goes back to the data source) before the last checkpoint;
        ``quiet``: on the way out of a failed run, a failure to is only logged."""
        try:
            status = await self.ops.rollout.stop_producer()
            self.ctx.events.record("producer.stop", next=status.next_rollout_id, published=status.published)
        except Exception as exc:
            if not quiet:
                raise
            log.warning("stopping the async producer: %s: %s", type(exc).__name__, exc)
        finally:
            if self.batches is not None:
                await self.batches.aclose()
                self.batches = None

    async def next_batch(self) -> Pick | None:
        """The newest batch within ``max_staleness`` (the staler ones dropped); None on a stop."""
        assert self.batches is not None, "start_producer first"
        pick = await self.batches.next(self.ops.version, lambda: self.ctx.stop_requested)
        if pick is None:
            return None
        if pick.dropped:
            self.ctx.events.record(
                "async.dropped", batches=[e.batch_id for e in pick.dropped], reason="staler than the bound"
            )
        self.ctx.status.last_batch_staleness = pick.staleness
        self.ctx.status.dropped_batches = self.batches.dropped_total
        self.ctx.events.record(
            "async.pick", batch_id=pick.entry.batch_id, staleness=pick.staleness, waiting=pick.waiting
        )
        return pick

    async def train(self, entry: StreamEntry) -> dict[str, float]:
        """Steps 37–40 on the picked batch; ``async/generation_during_train_s``: rollout seconds the
        producer ran while the ranks trained."""
        self.ctx.events.record("trainer.train", batch_id=entry.batch_id)
        ref = BatchRef(
            self.ops.redis_url, self.batches.run_id if self.batches else "", entry.batch_id, entry.rollout_id
        )
        t0, before = time.perf_counter(), await self.producer()
        result = await asyncio.to_thread(self.ops.backend.train, ref)
        during = (await self.producer()).generating_s - before.generating_s
        window = time.perf_counter() - t0  # from before the first read to after the second
        return {
            **train_metrics(result.steps),
            **batch_metrics(result.shares),
            "async/generation_during_train_s": during,
            "async/overlap": min(1.0, during / window) if window > 0 else 0.0,
        }

    async def producer(self) -> ProducerStatus:
        return await self.ops.rollout.producer()
