"""The reward service as the rollout loop scores with it (seed step 26).

Per sample (each sample scored by itself as soon as it is generated) or, with ``reward.group_rm``,
one batched call per group (``/v1/rewards`` with ``group=true``). ``reward.custom_rm_path`` names
the function; otherwise the service picks it (``metadata.rm_type`` of the sample, else its
configured ``rm_type``), which is how the synthetic task's ``arithmetic`` samples reach their
verifier.

Per-sample scores travel coalesced: requests that arrive while earlier ones are on the wire go
out together in one ``/v1/rewards`` call (``group=false``: still scored one by one). Under load
hundreds of single calls become a handful of batches — one HTTP round trip per sample cost the
rollout ~20 % of its throughput in ``bench/rollout_overhead.py`` — and at low load a sample still
goes out at once.

A call the service leaves unanswered for ``reward.stall_warning_s`` is logged as a warning naming
the stall (the console of `vime train` shows it), again while it lasts, and once more with its
length when the answer comes; the wait itself is bounded by the client's timeout
(``reward.request_timeout_s``), after which the rollout fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from vime.clients.reward import RewardClient
from vime.types import Sample
from vime.wire.reward import RewardRequest, RewardResult

log = logging.getLogger("vime.rollout.reward")

T = TypeVar("T")
MAX_BATCH = 256
"""Most per-sample requests in one coalesced call."""
SENDERS = 4
"""Coalesced calls on the wire at once (a slow batch does not hold the others back)."""

Pending = tuple[RewardRequest, "asyncio.Future[RewardResult]"]


def reward_request(sample: Sample) -> RewardRequest:
    """A sample's reward request: always its decoded text, even when empty (a response of only
    special tokens is scored, not refused)."""
    return RewardRequest(
        response=sample.response,
        label=sample.label,
        prompt=sample.prompt,
        metadata=dict(sample.metadata),
    )


def _details(r: RewardResult) -> dict[str, Any]:
    out: dict[str, Any] = {"status": r.status.value, "fn": r.fn}
    if r.pred is not None:
        out["pred"] = r.pred
    if r.error:
        out["error"] = r.error
    return out


class RewardScorer:
    """Adapter from the typed reward client to the loop's `Scorer` protocol."""

    def __init__(
        self,
        client: RewardClient,
        *,
        fn: str | None,
        group_rm: bool,
        stall_warning_s: float = 10.0,
        timeout_s: float | None = None,
    ) -> None:
        """``timeout_s``: the client's bound on one call, named in the stall warnings."""
        self.client = client
        self.fn = fn
        self.group_rm = group_rm
        self.stall_warning_s = stall_warning_s
        self.timeout_s = timeout_s
        self._queue: asyncio.Queue[Pending] | None = None
        self._senders: list[asyncio.Task[None]] = []

    async def aclose(self) -> None:
        for t in self._senders:
            t.cancel()
        for t in self._senders:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._senders.clear()
        await self.client.aclose()

    async def score(self, samples: list[Sample]) -> list[tuple[float, dict[str, Any] | None]]:
        requests = [reward_request(s) for s in samples]
        if self.group_rm:
            results = await self._watched(
                self.client.score_batch(requests, fn=self.fn, group=True), len(requests)
            )
        else:
            results = list(await asyncio.gather(*(self._one(r) for r in requests)))
        if len(results) != len(samples):
            raise RuntimeError(f"reward service answered {len(results)} results for {len(samples)} samples")
        return [(float(r.reward), _details(r)) for r in results]

    async def _one(self, request: RewardRequest) -> RewardResult:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._senders = [asyncio.create_task(self._send_loop(self._queue)) for _ in range(SENDERS)]
        future: asyncio.Future[RewardResult] = asyncio.get_running_loop().create_future()
        await self._queue.put((request, future))
        return await future

    async def _send_loop(self, queue: asyncio.Queue[Pending]) -> None:
        while True:
            batch = [await queue.get()]
            while len(batch) < MAX_BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                if len(batch) == 1:
                    results = [await self._watched(self.client.score(batch[0][0], fn=self.fn), 1)]
                else:
                    call = self.client.score_batch([r for r, _ in batch], fn=self.fn)
                    results = await self._watched(call, len(batch))
                if len(results) != len(batch):
                    raise RuntimeError(
                        f"reward service answered {len(results)} results for {len(batch)} samples"
                    )
            except Exception as exc:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), result in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(result)

    async def _watched(self, call: Awaitable[T], samples: int) -> T:
        """``call``'s answer; a warning every ``stall_warning_s`` it does not come, and one when it does."""
        task = asyncio.ensure_future(call)
        t0 = time.monotonic()
        warned = False
        try:
            while True:
                try:
                    result = await asyncio.wait_for(asyncio.shield(task), self.stall_warning_s)
                    break
                except TimeoutError:
                    warned = True
                    log.warning(
                        "reward service stalled: a scoring call of %d sample(s) to %s unanswered for %.0f s; "
                        "the rollout waits (up to reward.request_timeout_s=%s s)",
                        samples,
                        self.client.base_url,
                        time.monotonic() - t0,
                        "?" if self.timeout_s is None else f"{self.timeout_s:g}",
                    )
        finally:
            task.cancel()  # a no-op once it is done
        if warned:
            log.warning("reward service answered again after a %.1f s stall", time.monotonic() - t0)
        return result
