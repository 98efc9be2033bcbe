"""Redis transport of rollout batches from the rollout manager to the trainer's DP ranks (DESIGN §4).

One stream per run carries a small entry per batch; the payload is one blob per DP rank under its
own key, so a rank reads only its share and a redelivery re-sends a few hundred bytes, not the
batch. Each rank has its own consumer group (every rank sees every entry; synchronous DP needs
all ranks on the same batch). Delivery is at-least-once with idempotent consumption: the
batch id is deterministic, a rank records the batches it trained and skips a redelivered one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError, WatchError

from vime.batch import RankBatch, RolloutBatch, decode_rank_batch, encode_rank_batch


def stream_key(run_id: str) -> str:
    """The run's stream of batch entries."""
    return f"vime:{run_id}:batches"


def blob_prefix(run_id: str, batch_id: str) -> str:
    """Rank r's blob of a batch is under this prefix + str(r)."""
    return f"vime:{run_id}:blob:{batch_id}:"


def published_key(run_id: str, batch_id: str) -> str:
    """Guard that makes a second publish of the same batch id a no-op."""
    return f"vime:{run_id}:published:{batch_id}"


def trained_key(run_id: str, dp_rank: int) -> str:
    """Set of batch ids this rank has trained on (and acked)."""
    return f"vime:{run_id}:trained:rank{dp_rank}"


def dropped_key(run_id: str) -> str:
    """Set of batch ids the trainer dropped untrained (the async mode's stale batches)."""
    return f"vime:{run_id}:dropped"


def group_name(dp_rank: int) -> str:
    return f"rank{dp_rank}"


PUBLISH_ATTEMPTS = 5
"""Tries of a publish whose WATCH was broken without the batch being published (a lost connection)."""


class BatchTransportError(RuntimeError):
    """A stream entry cannot be served to this rank (blob missing, rank outside the batch's DP size)."""


RECONNECT_BACKOFF_S = (0.1, 2.0)
"""Backoff of a command sent again on a new connection: from 0.1 s doubling to 2 s, with jitter."""
RECONNECT_RETRIES = 20
"""Times a command is sent again after a lost connection (about 35 s of backoff): Redis killed
and restarted by the launcher (its data kept in the append-only file) is back within that."""


def reconnecting() -> Retry:
    """The one reconnect policy of every Redis client of vime (rollout manager, trainer ranks)."""
    base, cap = RECONNECT_BACKOFF_S
    backoff = ExponentialWithJitterBackoff(base=base, cap=cap)
    # A lost connection only: a command that timed out on a live connection is not sent again.
    return Retry(backoff, RECONNECT_RETRIES, supported_errors=(RedisConnectionError,))


def connect(redis_url: str, *, blocking: bool = False) -> aioredis.Redis:
    """A binary-safe client that reconnects (`reconnecting`); ``blocking`` ones have no socket
    timeout (redis-py 8 defaults to 5 s, which would cut every XREADGROUP BLOCK longer than that)."""
    return aioredis.Redis.from_url(
        redis_url,
        decode_responses=False,
        socket_connect_timeout=5,
        socket_timeout=None if blocking else 30,
        health_check_interval=30,
        retry=reconnecting(),
    )


async def ensure_group(r: aioredis.Redis, run_id: str, dp_rank: int) -> None:
    """Create rank ``dp_rank``'s group from the start of the stream (entries published before it
    existed are still delivered); an existing group keeps its position."""
    try:
        await r.xgroup_create(stream_key(run_id), group_name(dp_rank), id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


@dataclass(frozen=True)
class PublishResult:
    """What `BatchPublisher.publish` did: ``published`` is False for an already published batch id."""

    batch_id: str
    published: bool
    entry_id: str | None
    blob_bytes: int


class BatchPublisher:
    """Writes a batch's per-rank blobs and its stream entry, once per batch id (rollout manager side)."""

    def __init__(self, redis_url: str, run_id: str) -> None:
        self.run_id = run_id
        self._r = connect(redis_url)
        self._groups_for: int = 0

    async def publish(self, batch: RolloutBatch, rank_batches: Sequence[RankBatch]) -> PublishResult:
        """Blobs, guard key and XADD in one MULTI under WATCH of the guard: all or nothing, so a crash
        cannot leave a half-published batch, and a concurrent or repeated publish is a no-op."""
        _check_shares(self.run_id, batch, rank_batches)
        blobs = [encode_rank_batch(rb) for rb in rank_batches]
        size = sum(map(len, blobs))
        await self._ensure_groups(len(blobs))
        guard, prefix = published_key(self.run_id, batch.batch_id), blob_prefix(self.run_id, batch.batch_id)
        created = f"{time.time():.3f}"
        entry: dict[str, str | int] = {
            "batch_id": batch.batch_id,
            "rollout_id": batch.rollout_id,
            "weight_version": batch.weight_version,
            "weight_version_min": _oldest_version(batch),
            "n_samples": batch.num_samples,
            "dp_size": len(blobs),
            "blob_prefix": prefix,
            "created": created,
            "metrics": json.dumps(batch.metrics),
        }
        duplicate = PublishResult(batch.batch_id, False, None, 0)
        for _ in range(PUBLISH_ATTEMPTS):
            try:
                async with self._r.pipeline(transaction=True) as pipe:
                    await pipe.watch(guard)
                    if await pipe.exists(guard):
                        return duplicate
                    pipe.multi()
                    for rank, blob in enumerate(blobs):
                        pipe.set(prefix + str(rank), blob)
                    pipe.set(guard, created)
                    pipe.xadd(stream_key(self.run_id), entry)  # type: ignore[arg-type]
                    replies = await pipe.execute()
            except WatchError:
                # The guard was set between WATCH and EXEC (another publisher, or this EXEC whose
                # reply was lost with the connection), or the connection broke while watching:
                # the guard says which.
                if await self._r.exists(guard):
                    return duplicate
                continue
            return PublishResult(batch.batch_id, True, _text(replies[-1]), size)
        raise BatchTransportError(f"batch {batch.batch_id}: not published after {PUBLISH_ATTEMPTS} attempts")

    async def pending_count(self) -> int:
        """Batches published but not yet acked by the slowest rank (for backpressure)."""
        stream = stream_key(self.run_id)
        if not await self._r.exists(stream):
            return 0
        worst = 0
        for g in await self._r.xinfo_groups(stream):
            lag = g.get("lag")
            if lag is None:  # Redis cannot tell after deletions: count what lies past the group
                lag = len(await self._r.xrange(stream, b"(" + g["last-delivered-id"], "+") or [])
            worst = max(worst, int(g["pending"]) + int(lag))
        return worst

    async def _ensure_groups(self, dp_size: int) -> None:
        """Groups exist before the first entry, so backpressure counts batches no rank read yet."""
        for rank in range(self._groups_for, dp_size):
            await ensure_group(self._r, self.run_id, rank)
        self._groups_for = max(self._groups_for, dp_size)

    async def aclose(self) -> None:
        await self._r.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class BatchConsumer:
    """One DP rank's reader (trainer side): `next` a batch, train it, `ack` it after the optimizer step.

    ``consumer_name`` should be stable across restarts of the same rank: a restarted consumer of
    the same name first gets back what it had read but not acked. A consumer under a new name
    takes over a dead one's entries with `claim_stale`.
    """

    def __init__(self, redis_url: str, run_id: str, dp_rank: int, consumer_name: str) -> None:
        self.run_id, self.dp_rank, self.name = run_id, dp_rank, consumer_name
        self._stream, self._group = stream_key(run_id), group_name(dp_rank)
        self._trained = trained_key(run_id, dp_rank)
        self._r = connect(redis_url)
        self._blocking = connect(redis_url, blocking=True)
        self._handed: dict[str, bytes] = {}  # batch id -> entry id, handed out and not yet acked
        self._group_ready = False

    async def next(self, block_ms: int | None = None) -> RankBatch | None:
        """The next batch for this rank: own pending entries first (a redelivery after a crash or a
        claim), then new ones. ``block_ms``: None = don't wait, 0 = wait indefinitely, else wait up
        to that long. Batches this rank already trained are acked and skipped."""
        if not self._group_ready:
            await ensure_group(self._r, self.run_id, self.dp_rank)
            self._group_ready = True
        deadline = time.monotonic() + block_ms / 1000 if block_ms else None
        while True:
            entry = await self._own_pending() or await self._read_new(_wait_ms(block_ms, deadline))
            if entry is None:
                return None
            batch = await self._open(*entry)
            if batch is not None:
                return batch

    async def ack(self, batch_id: str) -> bool:
        """After the optimizer step: record ``batch_id`` as trained, XACK it, delete this rank's blob
        (one MULTI). False if no pending entry of this consumer carried that id (acked already)."""
        entry_id = self._handed.pop(batch_id, None) or await self._find_pending(batch_id)
        await self._finish(batch_id, entry_id)
        return entry_id is not None

    async def claim_stale(self, min_idle_ms: int, count: int = 100) -> list[str]:
        """Take over this rank's entries that another consumer read and left unacked for
        ``min_idle_ms`` (XAUTOCLAIM); `next` then returns them. Choose ``min_idle_ms`` above the
        longest training step, or a live consumer's batch is taken over too."""
        claimed: list[str] = []
        cursor: bytes | str = "0-0"
        while True:
            reply = await self._r.xautoclaim(
                self._stream, self._group, self.name, min_idle_ms, start_id=cursor, count=count
            )
            cursor, entries = reply[0], reply[1]
            claimed.extend(_text(entry_id) for entry_id, _ in entries)
            if cursor in (b"0-0", "0-0"):
                return claimed

    async def _own_pending(self) -> tuple[bytes, dict[bytes, bytes]] | None:
        """The oldest entry delivered to this consumer, unacked and not handed out by this instance."""
        reply = await self._r.xreadgroup(
            self._group, self.name, {self._stream: "0"}, count=len(self._handed) + 1
        )
        in_flight = set(self._handed.values())
        for entry_id, fields in _entries(reply):
            if entry_id not in in_flight:
                return entry_id, fields
        return None

    async def _read_new(self, block_ms: int | None) -> tuple[bytes, dict[bytes, bytes]] | None:
        reply = await self._blocking.xreadgroup(
            self._group, self.name, {self._stream: ">"}, count=1, block=block_ms
        )
        entries = _entries(reply)
        return entries[0] if entries else None

    async def _open(self, entry_id: bytes, fields: dict[bytes, bytes]) -> RankBatch | None:
        """The rank batch of an entry, or None after acking an entry that needs no training."""
        if not fields:  # the entry was deleted from the stream while pending
            await self._r.xack(self._stream, self._group, entry_id)
            return None
        meta = {_text(k): _text(v) for k, v in fields.items()}
        batch_id = meta["batch_id"]
        if batch_id in self._handed:  # a second entry of a batch in flight here: one is enough
            await self._r.xack(self._stream, self._group, entry_id)
            return None
        if await self._r.sismember(self._trained, batch_id) or await self._r.sismember(
            dropped_key(self.run_id), batch_id
        ):
            await self._finish(batch_id, entry_id, record=False)
            return None
        if self.dp_rank >= int(meta["dp_size"]):
            raise BatchTransportError(
                f"batch {batch_id} was split for DP size {meta['dp_size']}, this is rank {self.dp_rank}: "
                "the trainer's DP size must match the rollout manager's"
            )
        batch = await get_share(self._r, meta["blob_prefix"] + str(self.dp_rank), batch_id, self.dp_rank)
        self._handed[batch_id] = entry_id
        return batch

    async def _finish(self, batch_id: str, entry_id: bytes | None, record: bool = True) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            if record:
                pipe.sadd(self._trained, batch_id)
            if entry_id is not None:
                pipe.xack(self._stream, self._group, entry_id)
            pipe.delete(blob_prefix(self.run_id, batch_id) + str(self.dp_rank))
            await pipe.execute()

    async def _find_pending(self, batch_id: str) -> bytes | None:
        """This consumer's pending entry carrying ``batch_id`` (an ack after a restart)."""
        cursor: bytes | str = "0"
        while True:
            reply = await self._r.xreadgroup(self._group, self.name, {self._stream: cursor}, count=100)
            entries = _entries(reply)
            for entry_id, fields in entries:
                if fields.get(b"batch_id") == batch_id.encode():
                    return entry_id
            if not entries:
                return None
            cursor = entries[-1][0]

    async def aclose(self) -> None:
        await self._r.aclose()
        await self._blocking.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def get_share(r: aioredis.Redis, key: str, batch_id: str, dp_rank: int) -> RankBatch:
    """Rank ``dp_rank``'s share of ``batch_id`` from its blob ``key`` (`blob_prefix` + rank),
    checked to be that share."""
    blob = await r.get(key)
    if blob is None:
        raise BatchTransportError(f"batch {batch_id}: blob {key} is missing")
    batch = decode_rank_batch(cast(bytes, blob))  # decode_responses=False
    if (batch.batch_id, batch.dp_rank) != (batch_id, dp_rank):
        raise BatchTransportError(
            f"blob {key} holds batch {batch.batch_id} rank {batch.dp_rank}, not batch {batch_id} rank {dp_rank}"
        )
    return batch


def _check_shares(run_id: str, batch: RolloutBatch, rank_batches: Sequence[RankBatch]) -> None:
    """The shares belong to this batch and run, one per rank in order, and cover every sample."""
    if batch.run_id != run_id:
        raise ValueError(f"batch {batch.batch_id} belongs to run {batch.run_id!r}, not {run_id!r}")
    if not rank_batches:
        raise ValueError(f"batch {batch.batch_id}: no rank batches to publish")
    for rank, rb in enumerate(rank_batches):
        if (rb.batch_id, rb.dp_rank, rb.dp_size) != (batch.batch_id, rank, len(rank_batches)):
            raise ValueError(
                f"share {rank} is batch {rb.batch_id} rank {rb.dp_rank}/{rb.dp_size}, expected "
                f"batch {batch.batch_id} rank {rank}/{len(rank_batches)}"
            )
    if sum(rb.num_samples for rb in rank_batches) != batch.num_samples:
        raise ValueError(
            f"batch {batch.batch_id}: the shares do not add up to its {batch.num_samples} samples"
        )


def _oldest_version(batch: RolloutBatch) -> int:
    """The oldest weight version any token of the batch was sampled with (what bounds its staleness)."""
    if batch.num_samples == 0:
        return batch.weight_version
    return int(batch.first_weight_versions.min())


def _entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Entries of an XREADGROUP reply: ``[[stream, entries]]`` (redis-py's legacy shape, the default)
    or ``{stream: entries}`` (``legacy_responses=False``). A deleted entry has no fields."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else [s[1] for s in reply]
    return [(entry_id, fields or {}) for entries in streams for entry_id, fields in entries]


def _wait_ms(block_ms: int | None, deadline: float | None) -> int | None:
    """What is left of the caller's wait (None: don't block, 0: block indefinitely)."""
    if deadline is None:
        return block_ms
    left = int((deadline - time.monotonic()) * 1000)
    return left if left > 0 else None


def _text(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
