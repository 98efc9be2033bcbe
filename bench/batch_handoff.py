"""Batch hand-off to the training ranks: each rank reading its own share from Redis against the
driver reading every share and re-shipping it through Ray's object store, in the same run.

A private Redis and ``tp × dp`` Ray actors standing in for the training ranks (default the seed's
TP=2 × DP=4: 8 actors). Each round publishes a rollout batch of the seed's size (256 samples of
``--prompt-len`` + ``--response-len`` tokens, with rollout log-probs, split over the DP ranks in
micro-batches of 8) as the rollout manager does, then times, from "the driver knows the batch id"
to "every rank holds its share":

- ``ranks`` (the trainer's path): the driver sends each actor the batch's `BatchRef`; TP rank 0 of
  every DP rank reads through its consumer (`ShareReader`), its TP peer the same blob by key;
- ``driver`` (the baseline, the trainer's path before): the driver reads every DP rank's share
  through its own consumers, decodes it, ``ray.put``s it, and each actor receives its share.

Both report the driver's peak heap during the hand-off (tracemalloc: Python objects and numpy
buffers) and the wall time, next to a call to every actor that carries no batch (the floor of
both); the ranks return the summary the step's ``batch/*`` metrics need.

    python bench/batch_handoff.py [--rounds 5] [--tp 2] [--dp 4] [--prompt-len 100] [--response-len 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import tracemalloc
from dataclasses import replace
from typing import Any

import numpy as np
import ray
from rich.console import Console
from rich.table import Table
from vime_trainer.batches import BatchRef, ShareReader, ShareSummary

from vime import procs
from vime.algorithms import build_dp_schedule
from vime.batch import RankBatch, RolloutBatch, encode_rank_batch, split_by_dp
from vime.queue import BatchConsumer, BatchPublisher
from vime.types import Sample, SampleStatus

console = Console()
MIB = float(1 << 20)


class Rank:
    """A training rank's batch hand-off without the model: it holds its share and summarises it."""

    def __init__(self, dp_rank: int, tp_rank: int) -> None:
        self.dp_rank, self.tp_rank = dp_rank, tp_rank
        self.loop = asyncio.new_event_loop()
        self.reader: ShareReader | None = None

    def take(self, share: RankBatch) -> ShareSummary:
        """The baseline: Ray hands the share over (from the object store)."""
        return ShareSummary.of(share)

    def read(self, ref: BatchRef) -> ShareSummary:
        """The trainer's path: read the share from Redis (`TrainRank.read_and_train` does the same)."""
        if self.reader is None:
            self.reader = ShareReader(
                ref.redis_url, self.dp_rank, consumes=self.tp_rank == 0, name_prefix="bench"
            )
        return ShareSummary.of(self.loop.run_until_complete(self.reader.read(ref)))

    def ack(self, batch_id: str) -> None:
        assert self.reader is not None
        self.loop.run_until_complete(self.reader.ack(batch_id))

    def nothing(self) -> None:
        """The floor: a call to every actor that carries no batch."""


def rollout(args: argparse.Namespace) -> tuple[RolloutBatch, list[RankBatch]]:
    """256 samples (32 prompts × 8) of prompt + response tokens with log-probs, split as the seed's."""
    rng = np.random.default_rng(0)
    n, r = args.samples, args.response_len
    samples = [
        Sample(
            tokens=rng.integers(0, 151_936, args.prompt_len + r).tolist(),
            response_length=r,
            loss_mask=[1] * r,
            rollout_log_probs=(-rng.random(r)).tolist(),
            status=SampleStatus.COMPLETED,
            index=i,
            group_index=i // 8,
            weight_version="1",
        )
        for i in range(n)
    ]
    batch = RolloutBatch.from_samples(
        samples, batch_id="b", run_id="bench", rollout_id=0, weight_version=1, advantages=[0.5] * n
    )
    schedule = build_dp_schedule(batch.total_lengths().tolist(), n, 8, args.dp)
    return batch, split_by_dp(batch, schedule)


async def publish(url: str, stream: str, batch: RolloutBatch, shares: list[RankBatch], k: int) -> str:
    batch_id = f"{stream}:{k}"
    whole = replace(batch, batch_id=batch_id, run_id=stream)
    async with BatchPublisher(url, stream) as pub:
        await pub.publish(whole, [replace(s, batch_id=batch_id, run_id=stream) for s in shares])
    return batch_id


def measured(fn: Any, *args: Any) -> tuple[Any, float, float]:
    """``fn(*args)``'s result, seconds, and the driver's peak heap above where it started (MiB)."""
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    out = fn(*args)
    seconds = time.perf_counter() - t0
    return out, seconds, (tracemalloc.get_traced_memory()[1] - base) / MIB


def by_driver(
    consumers: list[BatchConsumer], loop: asyncio.AbstractEventLoop, actors: list[Any], dps: list[int]
) -> list[ShareSummary]:
    """The baseline: the driver reads and decodes every share, ``ray.put``s it, each actor gets its own."""
    got = asyncio.run_coroutine_threadsafe(_next_all(consumers), loop).result()
    refs = [ray.put(s) for s in got]
    return list(ray.get([a.take.remote(refs[d]) for a, d in zip(actors, dps, strict=True)]))


def by_ranks(actors: list[Any], ref: BatchRef) -> list[ShareSummary]:
    """The trainer's path: the driver sends where the batch is, every actor reads its share."""
    return list(ray.get([a.read.remote(ref) for a in actors]))


def floor(actors: list[Any]) -> None:
    ray.get([a.nothing.remote() for a in actors])


async def _next_all(consumers: list[BatchConsumer]) -> list[RankBatch]:
    got = await asyncio.gather(*(c.next(block_ms=10_000) for c in consumers))
    assert all(s is not None for s in got), "a share did not arrive"
    return [s for s in got if s is not None]


async def rounds(args: argparse.Namespace, url: str, actors: list[Any], dps: list[int]) -> dict[str, Any]:
    batch, shares = rollout(args)
    consumers = [BatchConsumer(url, "handoff-driver", d, f"driver-rank{d}") for d in range(args.dp)]
    loop = asyncio.get_running_loop()
    out: dict[str, list[tuple[float, float]]] = {"driver": [], "ranks": [], "floor": []}
    got: dict[str, list[ShareSummary]] = {}
    tracemalloc.start()
    try:
        for k in range(args.rounds + 1):  # round 0 warms up both paths (connections, actor imports)
            batch_id = await publish(url, "handoff-driver", batch, shares, k)
            got["driver"], seconds, peak = await asyncio.to_thread(
                measured, by_driver, consumers, loop, actors, dps
            )
            await asyncio.gather(*(c.ack(batch_id) for c in consumers))
            if k:
                out["driver"].append((seconds, peak))
            batch_id = await publish(url, "handoff-ranks", batch, shares, k)
            ref = BatchRef(url, "handoff-ranks", batch_id, 0)
            got["ranks"], seconds, peak = await asyncio.to_thread(measured, by_ranks, actors, ref)
            ray.get([a.ack.remote(batch_id) for a in actors])
            if k:
                out["ranks"].append((seconds, peak))
            _, seconds, peak = await asyncio.to_thread(measured, floor, actors)
            if k:
                out["floor"].append((seconds, peak))
    finally:
        tracemalloc.stop()
        await asyncio.gather(*(c.aclose() for c in consumers))
    assert got["driver"] == got["ranks"], "both paths must hand over the same shares"
    nbytes = sum(len(encode_rank_batch(s)) for s in shares)
    return {"rounds": out, "blob_bytes": nbytes, "tokens": int(batch.token_offsets[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--response-len", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as data:
        port = procs.free_port()
        redis = procs.start_redis(port, data, appendonly=False)
        ray.init(num_cpus=args.tp * args.dp, include_dashboard=False, log_to_driver=False)
        try:
            remote = ray.remote(num_cpus=1)(Rank)
            dps = [d for d in range(args.dp) for _ in range(args.tp)]
            actors = [remote.remote(d, t) for d in range(args.dp) for t in range(args.tp)]
            result = asyncio.run(rounds(args, f"redis://127.0.0.1:{port}/0", actors, dps))
        finally:
            ray.shutdown()
            redis.stop()
    show(args, result)


def show(args: argparse.Namespace, result: dict[str, Any]) -> None:
    med = {k: (statistics.median(s for s, _ in v), max(p for _, p in v)) for k, v in result["rounds"].items()}
    table = Table(
        title=f"{args.samples} samples, {result['tokens']:,} tokens, {result['blob_bytes'] / MIB:.1f} MiB of "
        f"blobs, TP={args.tp} × DP={args.dp} ranks, {args.rounds} rounds"
    )
    for col in ("hand-off", "median s", "driver peak heap MiB"):
        table.add_column(col)
    rows = (
        ("driver", "driver reads, ray.put (before)"),
        ("ranks", "ranks read (now)"),
        ("floor", "a call to every actor, no batch"),
    )
    for name, label in rows:
        table.add_row(label, f"{med[name][0]:.3f}", f"{med[name][1]:.1f}")
    console.print(table)
    console.print(
        f"ranks / driver: time {med['ranks'][0] / med['driver'][0]:.2f}×, "
        f"driver peak heap {med['ranks'][1] / max(med['driver'][1], 1e-9):.3f}×"
    )


if __name__ == "__main__":
    main()
