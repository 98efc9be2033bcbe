"""An engine's scheduler load sampled while a block of a bench runs: does a batch of requests run
as one batch, or does part of it wait?

``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (vLLM's gauges, which the
reference engine serves too) are read from ``GET /metrics`` every ``interval_s`` while the block
runs. The summary says how many requests ran at once at most, how long after the block's start
that peak was first reached, how many waited at most, and the mean running over the block: for
the seed's 256 requests on one engine, a peak below 256 or a late peak means they did not all
run together.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx

from vime.wire.engine_metrics import metric_sum

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


class LoadSamples:
    """(seconds since the start, running, waiting) per sample."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {}
        peak = max(r for _, r, _ in self.samples)
        return {
            "peak_running": peak,
            "s_to_peak_running": next(t for t, r, _ in self.samples if r == peak),
            "peak_waiting": max(w for _, _, w in self.samples),
            "mean_running": sum(r for _, r, _ in self.samples) / len(self.samples),
        }


@contextlib.asynccontextmanager
async def engine_load(engine_url: str, interval_s: float = 0.25) -> AsyncIterator[LoadSamples]:
    """Sample the engine's running / waiting requests until the block ends."""
    load = LoadSamples()
    t0 = time.perf_counter()

    async def sample(http: httpx.AsyncClient) -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                text = (await http.get("/metrics")).content
                running, waiting = metric_sum(text, [RUNNING]), metric_sum(text, [WAITING])
                if running is not None and waiting is not None:
                    load.samples.append((time.perf_counter() - t0, running, waiting))
            await asyncio.sleep(interval_s)

    async with httpx.AsyncClient(base_url=engine_url, timeout=5) as http:
        task = asyncio.create_task(sample(http))
        try:
            yield load
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
