"""The training ranks' `ShareReader` against a real Redis: each DP rank's reader follows the stream
the rollout manager's reply names (warm-up batches on ``<run>:sft``, rollouts on ``<run>``), skips
an earlier attempt left pending and, after a resume from an older checkpoint, the batches of later
rollouts (returning what it skipped, which the driver logs), and acks its share; a TP peer reads the
same share by key, until the ack frees it."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
from vime_rollout.batch_builder import build_batch
from vime_rollout.sft import build_sft_batch, sft_stream_run_id
from vime_trainer.batches import BatchReadError, BatchRef, ShareReader, log_skipped

from vime.batch import RankBatch
from vime.config import RunConfig, load_config
from vime.queue import BatchPublisher, BatchTransportError
from vime.types import Sample, SampleStatus


def _cfg() -> RunConfig:
    over = [
        "rollout_batch_size=2",
        "n_samples_per_prompt=2",
        "micro_batch_size=2",
        "rollout_num_gpus=0",
        "actor_num_gpus_per_node=0",
        "actor_num_cpu_ranks=2",
        "tensor_model_parallel_size=1",
    ]
    return load_config(overrides=over, environ={})


def _samples(n: int, group_size: int = 1) -> list[Sample]:
    return [
        Sample(
            tokens=[1, 2, 3, 4 + i],
            response_length=2,
            loss_mask=[1, 1],
            reward=float(i % 2),
            status=SampleStatus.COMPLETED,
            index=i,
            group_index=i // group_size,
        )
        for i in range(n)
    ]


async def _publish_sft(redis_url: str, run: str, step: int, attempt: int) -> str:
    stream = sft_stream_run_id(run)
    batch_id = f"{stream}:{step}:{attempt}"
    built = build_sft_batch(_cfg(), _samples(4), batch_id=batch_id, run_id=stream, step=step, dp_size=2)
    async with BatchPublisher(redis_url, stream) as pub:
        await pub.publish(built.batch, built.shares)
    return batch_id


class Ranks:
    """The readers of two DP ranks (each TP rank 0, holding its consumer), as the ranks hold them."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.redis_url = redis_url
        self.readers = [ShareReader(redis_url, d, consumes=True, name_prefix=prefix) for d in range(2)]

    async def read(
        self, run_id: str, batch_id: str, rollout_id: int, timeout_s: float = 10
    ) -> list[RankBatch]:
        ref = BatchRef(self.redis_url, run_id, batch_id, rollout_id)
        return list(await asyncio.gather(*(r.read(ref, timeout_s) for r in self.readers)))

    async def ack(self, batch_id: str) -> None:
        await asyncio.gather(*(r.ack(batch_id) for r in self.readers))

    async def aclose(self) -> None:
        await asyncio.gather(*(r.aclose() for r in self.readers))


async def test_reads_each_batch_from_the_stream_its_reply_names(redis_url: str) -> None:
    run = f"bt-{uuid.uuid4().hex[:8]}"
    stale = await _publish_sft(redis_url, run, 0, 0)  # an attempt whose reply was lost
    sft0 = await _publish_sft(redis_url, run, 0, 1)
    groups = [_samples(4, 2)[:2], _samples(4, 2)[2:]]
    built = build_batch(
        _cfg(), groups, batch_id=f"{run}:0:0", run_id=run, rollout_id=0, weight_version=1, dp_size=2
    )
    async with BatchPublisher(redis_url, run) as pub:
        await pub.publish(built.batch, built.shares)
    ranks = Ranks(redis_url, f"t-{run}")
    peer = ShareReader(redis_url, 1, consumes=False)  # DP rank 1's TP peer
    try:
        shares = await ranks.read(sft_stream_run_id(run), sft0, 0)
        assert [(s.batch_id, s.dp_rank, s.num_samples) for s in shares] == [(sft0, 0, 2), (sft0, 1, 2)]
        assert all(float(s.advantages.min()) == 1.0 for s in shares) and stale != sft0
        await ranks.ack(sft0)
        warm_consumer = ranks.readers[0]._consumer
        rl = await ranks.read(run, f"{run}:0:0", 0)  # the RL stream: the SFT one closed
        assert [s.batch_id for s in rl] == [f"{run}:0:0"] * 2 and ranks.readers[
            0
        ]._consumer is not warm_consumer
        seen = await peer.read(BatchRef(redis_url, run, f"{run}:0:0", 0))
        assert (seen.batch_id, seen.dp_rank) == (f"{run}:0:0", 1)
        assert seen.tokens.tolist() == rl[1].tokens.tolist()  # the peer trains on the same share
        await ranks.ack(f"{run}:0:0")
        with pytest.raises(BatchTransportError, match="is missing"):  # the ack freed the blob
            await peer.read(BatchRef(redis_url, run, f"{run}:0:0", 0))
        with pytest.raises(BatchReadError, match="no batch to read"):
            await ranks.read("", f"{run}:0:0", 0)
        with pytest.raises(BatchReadError, match="did not arrive"):
            await ranks.read(run, f"{run}:1:0", 1, timeout_s=1)
    finally:
        await ranks.aclose()
        await peer.aclose()
    async with BatchPublisher(redis_url, run) as pub:
        assert await pub.pending_count() == 0  # every rank acked the RL batch
    async with BatchPublisher(redis_url, sft_stream_run_id(run)) as pub:
        assert await pub.pending_count() == 0  # and the warm-up ones (the stale attempt skipped)


async def _publish_rollout(redis_url: str, run: str, rollout_id: int, attempt: int) -> str:
    batch_id = f"{run}:{rollout_id}:{attempt}"
    groups = [_samples(4, 2)[:2], _samples(4, 2)[2:]]
    built = build_batch(
        _cfg(), groups, batch_id=batch_id, run_id=run, rollout_id=rollout_id, weight_version=1, dp_size=2
    )
    async with BatchPublisher(redis_url, run) as pub:
        await pub.publish(built.batch, built.shares)
    return batch_id


async def test_batches_of_later_rollouts_are_stale_after_a_resume(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The run trained up to rollout 2, crashed while rollout 2 trained (read, never acked) with
    rollout 3 already published, and resumes from its checkpoint after rollout 0: rollout 1 is
    generated again and must be what it trains on, the batches of 2 and 3 skipped for good."""
    run = f"bt-{uuid.uuid4().hex[:8]}"
    name = f"t-{run}"
    crashed = Ranks(redis_url, name)
    try:
        in_flight = await _publish_rollout(redis_url, run, 2, 0)
        assert [s.batch_id for s in await crashed.read(run, in_flight, 2)] == [in_flight] * 2
    finally:
        await crashed.aclose()  # no ack: the entries stay pending for these consumer names
    unread = await _publish_rollout(redis_url, run, 3, 0)
    again = await _publish_rollout(redis_url, run, 1, 1)  # the resumed run's rollout 1 (attempt 1)
    resumed = Ranks(redis_url, name)
    try:
        shares = await resumed.read(run, again, 1)
        assert [(s.batch_id, s.rollout_id, s.dp_rank) for s in shares] == [(again, 1, 0), (again, 1, 1)]
        assert all(
            r.skipped == [(in_flight, 2), (unread, 3)] for r in resumed.readers
        )  # what each rank returns
        with caplog.at_level(logging.INFO, logger="vime.trainer.batches"):
            log_skipped(resumed.readers[0].skipped, BatchRef(redis_url, run, again, 1))  # the driver's log
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 2 and all("resumed at rollout 1" in m for m in warned)
        assert in_flight in warned[0] and unread in warned[1]
        await resumed.ack(again)
        later = await _publish_rollout(redis_url, run, 2, 1)  # rollout 2 regenerated: a new batch id
        assert [s.batch_id for s in await resumed.read(run, later, 2)] == [later] * 2
        await resumed.ack(later)
    finally:
        await resumed.aclose()
    async with BatchPublisher(redis_url, run) as pub:
        assert await pub.pending_count() == 0  # the stale batches were acked, never left pending
