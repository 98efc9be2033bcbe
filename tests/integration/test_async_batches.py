"""The async mode's batch choice against a real Redis: the newest batch within the bound is trained,
the others are dropped before any rank reads (the ranks then skip them without recording them
trained), leftovers of an earlier run are dropped at (re)start, and a producer that stopped with an
error ends the wait."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
from vime_trainer.async_batches import AsyncBatches, ProducerStopped

from vime.algorithms import build_dp_schedule
from vime.batch import RolloutBatch, split_by_dp
from vime.queue import BatchConsumer, BatchPublisher, dropped_key, trained_key
from vime.queue_waiting import waiting_entries
from vime.types import Sample, SampleStatus
from vime.wire.rollout import ProducerStatus


class FakeProducer:
    """The rollout client's producer status, as the trainer polls it while it waits."""

    def __init__(self, run_id: str) -> None:
        self.status = ProducerStatus(running=True, run_id=run_id)

    async def producer(self) -> ProducerStatus:
        return self.status


def batch(run_id: str, rollout_id: int, first_version: int) -> RolloutBatch:
    samples = []
    for i in range(4):
        s = Sample(tokens=[1, 2, 3], index=4 * rollout_id + i, group_index=rollout_id, reward=float(i % 2))
        s.append_response_tokens([5, 6])
        s.status, s.weight_version = SampleStatus.COMPLETED, str(first_version + 1)
        s.first_weight_version = str(first_version)
        samples.append(s)
    return RolloutBatch.from_samples(
        samples,
        batch_id=f"{run_id}:{rollout_id}:0",
        run_id=run_id,
        rollout_id=rollout_id,
        weight_version=first_version,
        advantages=[0.0] * 4,
    )


async def publish(redis_url: str, run_id: str, *specs: tuple[int, int]) -> None:
    async with BatchPublisher(redis_url, run_id) as pub:
        for rollout_id, first_version in specs:
            b = batch(run_id, rollout_id, first_version)
            await pub.publish(b, split_by_dp(b, build_dp_schedule(b.total_lengths().tolist(), 4, 4, 1)))


@pytest.fixture
def run_id() -> str:
    return "async-" + uuid.uuid4().hex[:8]


async def test_newest_fresh_batch_is_trained_and_the_staler_ones_never_are(
    redis_url: str, run_id: str
) -> None:
    await publish(redis_url, run_id, (0, 1), (1, 2), (2, 3))
    reader = AsyncBatches(redis_url, run_id, FakeProducer(run_id), max_staleness=1)  # type: ignore[arg-type]
    try:
        pick = await reader.next(version=3, stopping=lambda: False)
        assert pick is not None and pick.entry.rollout_id == 2 and pick.staleness == 0 and pick.waiting == 3
        assert [e.rollout_id for e in pick.dropped] == [0, 1] and reader.dropped_total == 2
        r = aioredis.Redis.from_url(redis_url)
        assert [e.rollout_id for e in await waiting_entries(r, run_id)] == [2]  # not taken by a rank yet
        async with BatchConsumer(redis_url, run_id, 0, "trainer-rank0") as rank:
            share = await rank.next()  # the rank meets the dropped ones first and skips them
            assert share is not None and share.rollout_id == 2
            await rank.ack(share.batch_id)
        assert await waiting_entries(r, run_id) == []
        assert await r.smembers(trained_key(run_id, 0)) == {f"{run_id}:2:0".encode()}
        assert await r.smembers(dropped_key(run_id)) == {f"{run_id}:{k}:0".encode() for k in (0, 1)}
        await r.aclose()
        assert await reader.next(version=4, stopping=lambda: True) is None  # a stop ends the wait
    finally:
        await reader.aclose()


async def test_leftovers_are_dropped_at_start_and_a_failed_producer_ends_the_wait(
    redis_url: str, run_id: str
) -> None:
    await publish(redis_url, run_id, (3, 4), (4, 4), (5, 5))
    producer = FakeProducer(run_id)
    reader = AsyncBatches(redis_url, run_id, producer, max_staleness=1)  # type: ignore[arg-type]
    try:
        # A resume at rollout 4 whose checkpoint had seen rollouts up to 4 published keeps rollout 4.
        gone = await reader.drop_leftovers(lambda e: 4 <= e.rollout_id < 5)
        assert [e.rollout_id for e in gone] == [3, 5]
        pick = await reader.next(version=5, stopping=lambda: False)
        assert pick is not None and pick.entry.rollout_id == 4 and pick.staleness == 1 and not pick.dropped
        async with BatchConsumer(redis_url, run_id, 0, "trainer-rank0") as rank:
            share = await rank.next()
            assert share is not None
            await rank.ack(share.batch_id)
        producer.status = ProducerStatus(running=False, run_id=run_id, error="rollout 6: RuntimeError: boom")
        with pytest.raises(ProducerStopped, match="boom"):
            await asyncio.wait_for(reader.next(version=6, stopping=lambda: False), 30)
    finally:
        await reader.aclose()
