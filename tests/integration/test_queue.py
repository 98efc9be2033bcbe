"""The Redis batch transport against a real redis-server: shares per rank, at-least-once delivery
with idempotent consumption, ack-then-delete, takeover of a dead consumer, long blocking reads."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis

from vime.algorithms import build_dp_schedule
from vime.batch import RankBatch, RolloutBatch, split_by_dp
from vime.queue import (
    BatchConsumer,
    BatchPublisher,
    BatchTransportError,
    blob_prefix,
    group_name,
    stream_key,
)
from vime.types import Sample, SampleStatus

DP = 4
REPO = Path(__file__).resolve().parents[2]


def make_batch(run_id: str, rollout_id: int = 0, n: int = 32) -> tuple[RolloutBatch, list[RankBatch]]:
    rng = np.random.default_rng(rollout_id)
    samples = []
    for i in range(n):
        s = Sample(tokens=rng.integers(0, 1000, 10 + i).tolist(), index=i, group_index=i // 8)
        r = int(rng.integers(1, 40))
        s.append_response_tokens(rng.integers(0, 1000, r).tolist(), rng.normal(size=r).tolist())
        s.status, s.reward = SampleStatus.COMPLETED, float(i % 2)
        samples.append(s)
    batch = RolloutBatch.from_samples(
        samples,
        batch_id=f"{run_id}:{rollout_id}:0",
        run_id=run_id,
        rollout_id=rollout_id,
        weight_version=rollout_id,
        advantages=[float(i % 2) - 0.5 for i in range(n)],
    )
    return batch, split_by_dp(batch, build_dp_schedule(batch.total_lengths().tolist(), n, 4, DP))


def same(a: RankBatch, b: RankBatch) -> bool:
    return (a.batch_id, a.dp_rank) == (b.batch_id, b.dp_rank) and all(
        x.tobytes() == y.tobytes() for x, y in zip(a.columns().values(), b.columns().values(), strict=True)
    )


@pytest.fixture
def run_id() -> str:
    return "run-" + uuid.uuid4().hex[:8]


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_url)
    yield r
    await r.aclose()


async def test_every_rank_consumes_its_own_share(redis_url: str, run_id: str, raw: aioredis.Redis) -> None:
    batch, shares = make_batch(run_id)
    async with BatchPublisher(redis_url, run_id) as pub:
        result = await pub.publish(batch, shares)
        assert result.published and result.entry_id and result.blob_bytes > 0
        assert await pub.pending_count() == 1
        consumers = [BatchConsumer(redis_url, run_id, r, f"trainer-{r}") for r in range(DP)]
        got = [await c.next() for c in consumers]
        for r, rb in enumerate(got):
            assert rb is not None and same(rb, shares[r]) and rb.num_samples == 8
        assert sorted(i for rb in got if rb for i in rb.sample_indices.tolist()) == list(range(32))
        assert [await c.next() for c in consumers] == [None] * DP  # nothing else, and no re-hand-out
        # data stays in Redis until each rank acks; then that rank's blob goes
        prefix = blob_prefix(run_id, batch.batch_id)
        assert await raw.exists(*[prefix + str(r) for r in range(DP)]) == DP
        assert await consumers[1].ack(batch.batch_id)
        assert not await raw.exists(prefix + "1")
        assert await raw.exists(prefix + "0", prefix + "2", prefix + "3") == 3
        assert await pub.pending_count() == 1  # ranks 0, 2, 3 still train on it
        for r in (0, 2, 3):
            assert await consumers[r].ack(batch.batch_id)
        assert await raw.exists(*[prefix + str(r) for r in range(DP)]) == 0
        assert await pub.pending_count() == 0
        for r in range(DP):
            assert (await raw.xpending(stream_key(run_id), group_name(r)))["pending"] == 0
            await consumers[r].aclose()


async def test_batches_arrive_in_order_and_groups_created_late_still_see_them(
    redis_url: str, run_id: str
) -> None:
    async with BatchPublisher(redis_url, run_id) as pub:
        published = [make_batch(run_id, k) for k in range(3)]
        for batch, shares in published:
            assert (await pub.publish(batch, shares)).published
        assert await pub.pending_count() == 3
        async with BatchConsumer(redis_url, run_id, 2, "late-joiner") as c:
            for batch, shares in published:
                rb = await c.next()
                assert rb is not None and same(rb, shares[2]) and rb.rollout_id == batch.rollout_id
                await c.ack(rb.batch_id)
            assert await c.next() is None


async def test_reader_that_dies_before_ack_gets_it_back_under_the_same_name(
    redis_url: str, run_id: str
) -> None:
    batch, shares = make_batch(run_id)
    async with BatchPublisher(redis_url, run_id) as pub:
        await pub.publish(batch, shares)
    first = BatchConsumer(redis_url, run_id, 0, "trainer-0")
    assert (await first.next()) is not None
    await first.aclose()  # gone without ack
    async with BatchConsumer(redis_url, run_id, 0, "trainer-0") as again:
        rb = await again.next()  # its own pending entry, redelivered
        assert rb is not None and same(rb, shares[0])
        assert await again.ack(rb.batch_id)
        assert await again.next() is None


CHILD = textwrap.dedent(
    """
    import asyncio, os, sys
    from vime.queue import BatchConsumer

    async def main():
        c = BatchConsumer(sys.argv[1], sys.argv[2], 1, "worker-a")
        rb = await c.next(block_ms=10_000)
        print(rb.batch_id, rb.num_samples, flush=True)
        os._exit(3)  # the process dies in the middle of training: no ack, no clean close

    asyncio.run(main())
    """
)


async def test_new_consumer_claims_what_a_killed_process_left_pending(
    redis_url: str, run_id: str, raw: aioredis.Redis
) -> None:
    batch, shares = make_batch(run_id)
    async with BatchPublisher(redis_url, run_id) as pub:
        await pub.publish(batch, shares)
    child = subprocess.run(
        [sys.executable, "-c", CHILD, redis_url, run_id], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 3, child.stderr
    assert child.stdout.split() == [batch.batch_id, "8"]
    async with BatchConsumer(redis_url, run_id, 1, "worker-b") as c:
        assert await c.next() is None  # nothing new: the entry is worker-a's pending one
        assert await c.claim_stale(min_idle_ms=60_000) == []  # not idle long enough yet
        await asyncio.sleep(0.3)
        claimed = await c.claim_stale(min_idle_ms=200)
        assert len(claimed) == 1
        rb = await c.next()
        assert rb is not None and same(rb, shares[1])
        assert await raw.exists(blob_prefix(run_id, batch.batch_id) + "1")  # still there until ack
        assert await c.ack(rb.batch_id)
        assert not await raw.exists(blob_prefix(run_id, batch.batch_id) + "1")
        assert await c.next() is None
        assert (await raw.xpending(stream_key(run_id), group_name(1)))["pending"] == 0


async def test_duplicate_publish_is_not_trained_twice(
    redis_url: str, run_id: str, raw: aioredis.Redis
) -> None:
    batch, shares = make_batch(run_id)
    async with BatchPublisher(redis_url, run_id) as pub, BatchPublisher(redis_url, run_id) as pub2:
        results = await asyncio.gather(pub.publish(batch, shares), pub2.publish(batch, shares))
        assert sorted(r.published for r in results) == [False, True]  # racing publishers: one wins
        again = await pub.publish(batch, shares)  # the rollout manager retries after a timeout
        assert not again.published and again.entry_id is None
        assert await raw.xlen(stream_key(run_id)) == 1
        async with BatchConsumer(redis_url, run_id, 0, "trainer-0") as c:
            rb = await c.next()
            assert rb is not None and rb.batch_id == batch.batch_id
            await c.ack(rb.batch_id)
            assert await c.next() is None
            # a retry after the ack writes nothing back (no orphan blob, no entry)
            assert not (await pub.publish(batch, shares)).published
            assert not await raw.exists(blob_prefix(run_id, batch.batch_id) + "0")
            # an entry that slipped past the guard (e.g. a publisher without it) is skipped and acked
            fields = (await raw.xrange(stream_key(run_id)))[0][1]
            await raw.xadd(stream_key(run_id), fields)
            assert await c.next() is None
            assert (await raw.xpending(stream_key(run_id), group_name(0)))["pending"] == 0


async def test_blocking_read_longer_than_five_seconds(redis_url: str, run_id: str) -> None:
    batch, shares = make_batch(run_id)
    async with BatchConsumer(redis_url, run_id, 3, "trainer-3") as c:
        await c.next()  # creates the group, returns None at once
        start = time.monotonic()
        waiting = asyncio.create_task(c.next(block_ms=9_000))
        await asyncio.sleep(5.5)  # past redis-py 8's default socket timeout of 5 s
        assert not waiting.done()
        async with BatchPublisher(redis_url, run_id) as pub:
            await pub.publish(batch, shares)
        rb = await waiting
        assert rb is not None and same(rb, shares[3])
        assert time.monotonic() - start > 5.0
        await c.ack(rb.batch_id)


async def test_rank_outside_the_batch_dp_size_is_refused(redis_url: str, run_id: str) -> None:
    batch, shares = make_batch(run_id)
    async with BatchPublisher(redis_url, run_id) as pub:
        await pub.publish(batch, shares)
        with pytest.raises(ValueError, match=r"share 0 is batch \S+ rank 0/4, expected batch \S+ rank 0/2"):
            await pub.publish(batch, [shares[0], shares[2]])
    async with BatchConsumer(redis_url, run_id, DP, "trainer-4") as c:
        with pytest.raises(BatchTransportError, match="split for DP size 4, this is rank 4"):
            await c.next()


async def test_the_entry_says_the_batch_s_oldest_weight_version_and_its_metrics(
    redis_url: str, run_id: str, raw: aioredis.Redis
) -> None:
    """A sample updated in flight carries its first token's version; the entry's
    ``weight_version_min`` is the oldest of them (what bounds the batch's staleness)."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(8):
        s = Sample(tokens=[1, 2, 3], index=i, group_index=0, weight_version="5", reward=float(i % 2))
        s.first_weight_version = "3" if i == 6 else "5"
        s.append_response_tokens(rng.integers(0, 100, 4).tolist())
        s.status = SampleStatus.COMPLETED
        samples.append(s)
    batch = RolloutBatch.from_samples(
        samples,
        batch_id=f"{run_id}:0:0",
        run_id=run_id,
        rollout_id=0,
        weight_version=4,
        advantages=[0.0] * 8,
        metrics={"rollout/reward_mean": 0.5},
    )
    assert batch.first_weight_versions.tolist() == [5] * 6 + [3, 5] and (batch.weight_versions == 5).all()
    shares = split_by_dp(batch, build_dp_schedule(batch.total_lengths().tolist(), 8, 4, 2))
    async with BatchPublisher(redis_url, run_id) as pub:
        await pub.publish(batch, shares)
    ((_, fields),) = await raw.xrange(stream_key(run_id))
    assert fields[b"weight_version"] == b"4" and fields[b"weight_version_min"] == b"3"
    assert fields[b"metrics"] == b'{"rollout/reward_mean": 0.5}'
    async with BatchConsumer(redis_url, run_id, 1, "t") as c:
        got = await c.next()
    assert got is not None  # a share keeps each of its samples' first version (sample index = row here)
    assert got.first_weight_versions.tolist() == batch.first_weight_versions[got.sample_indices].tolist()
