"""The async mode's view of a run's batch stream (`vime.queue`): the batches published and not
taken by any trainer rank yet, and the trainer's drops.

The rollout manager's producer starts a rollout only while fewer than ``max_staleness`` batches
wait; the trainer picks the batch to train among the waiting ones and drops the stale ones. A
dropped batch joins the run's dropped set: no rank trains it, each acks its entry when it meets
it (`vime.queue.BatchConsumer`), and the set counts what the run dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from vime.queue import dropped_key, stream_key


@dataclass(frozen=True)
class StreamEntry:
    """A batch's stream entry as the async mode reads it before any rank takes it."""

    entry_id: str
    batch_id: str
    rollout_id: int
    weight_version_min: int
    """The oldest weight version any of its tokens was sampled with."""
    n_samples: int
    metrics: dict[str, float]

    @classmethod
    def of(cls, entry_id: Any, fields: Mapping[Any, Any]) -> StreamEntry:
        f = {_text(k): _text(v) for k, v in fields.items()}
        return cls(
            entry_id=_text(entry_id),
            batch_id=f["batch_id"],
            rollout_id=int(f["rollout_id"]),
            weight_version_min=int(f.get("weight_version_min", f["weight_version"])),
            n_samples=int(f["n_samples"]),
            metrics={str(k): float(v) for k, v in json.loads(f.get("metrics", "{}")).items()},
        )


async def waiting_entries(r: aioredis.Redis, run_id: str) -> list[StreamEntry]:
    """Entries no rank has taken yet (past the slowest rank group's last delivered entry), oldest
    first, leaving out batches in the run's dropped set."""
    stream = stream_key(run_id)
    if not await r.exists(stream):
        return []
    groups = await r.xinfo_groups(stream)
    start = min((_entry_key(g["last-delivered-id"]) for g in groups), default=(0, 0))
    raw: list[Any] = await r.xrange(stream, f"({start[0]}-{start[1]}", "+") or []
    entries = [(eid, fields) for eid, fields in raw if fields]
    if not entries:
        return []
    dropped = await r.smismember(dropped_key(run_id), [e[1][b"batch_id"] for e in entries])
    return [StreamEntry.of(eid, fields) for (eid, fields), d in zip(entries, dropped, strict=True) if not d]


async def drop(r: aioredis.Redis, run_id: str, batch_ids: Sequence[str]) -> None:
    """Record batches as dropped: no rank trains them (each acks its entry when it meets it)."""
    if batch_ids:
        await r.sadd(dropped_key(run_id), *batch_ids)


def _entry_key(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = _text(entry_id).partition("-")
    return int(ms), int(seq or 0)


def _text(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
