"""Idempotency by sample id: a retried request is answered with the first answer, not scored again.

A request that carries a ``sample_id`` is keyed by it, together with a fingerprint of what it
asks (function, options, response, label), so a different sample reusing an id is scored afresh.
Duplicates that arrive while the first is still being scored wait for the same computation, which
runs as its own task so a caller that disconnects does not cancel it. Errors are not kept (a
remote server may be back on the retry); answers and timeouts are.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from vime.wire.reward import RewardRequest, RewardResult, RewardStatus

DEFAULT_CAPACITY = 65536


def fingerprint(fn: str, options: dict[str, Any], req: RewardRequest) -> str:
    """A digest of everything that decides a request's answer."""
    h = hashlib.blake2b(digest_size=16)
    head = json.dumps([fn, options, req.label, req.response_token_ids], sort_keys=True, default=repr)
    h.update(head.encode())
    h.update(b"\0")
    h.update((req.response or "").encode("utf-8", "surrogatepass"))
    return h.hexdigest()


class ResultCache:
    """Results by sample id (LRU, ``capacity`` entries) and the computations still running."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._done: OrderedDict[str, tuple[str, RewardResult]] = OrderedDict()
        self._running: dict[str, tuple[str, asyncio.Future[RewardResult]]] = {}

    def get(self, key: str, digest: str) -> RewardResult | None:
        """The kept answer for ``key`` if it was for the same request."""
        entry = self._done.get(key)
        if entry is None or entry[0] != digest:
            return None
        self._done.move_to_end(key)
        return entry[1]

    def put(self, key: str, digest: str, result: RewardResult) -> None:
        """Keep ``result`` unless it is an error."""
        if result.status == RewardStatus.ERROR:
            return
        self._done[key] = (digest, result)
        self._done.move_to_end(key)
        while len(self._done) > self.capacity:
            self._done.popitem(last=False)

    async def once(
        self, key: str, digest: str, compute: Callable[[], Awaitable[RewardResult]]
    ) -> tuple[RewardResult, bool]:
        """(result, True) for a repeat of a known or running request, else (computed result, False)."""
        waiting, repeated = self.begin(key, digest, compute)
        return await waiting, repeated

    def begin(
        self, key: str, digest: str, compute: Callable[[], Awaitable[RewardResult]]
    ) -> tuple[asyncio.Future[RewardResult], bool]:
        """`once` without the wait (what to await, and whether it is a repeat), so a caller can
        start many before scoring the new ones together; ``compute()`` may return a future."""
        kept = self.get(key, digest)
        if kept is not None:
            answer: asyncio.Future[RewardResult] = asyncio.get_running_loop().create_future()
            answer.set_result(kept)
            return answer, True
        running = self._running.get(key)
        if running is not None and running[0] == digest:
            return asyncio.shield(running[1]), True
        task = asyncio.ensure_future(compute())
        self._running[key] = (digest, task)
        task.add_done_callback(lambda t: self._settle(key, digest, t))
        return asyncio.shield(task), False

    def _settle(self, key: str, digest: str, task: asyncio.Future[RewardResult]) -> None:
        if self._running.get(key, (None, None))[1] is task:
            del self._running[key]
        if not task.cancelled() and task.exception() is None:
            self.put(key, digest, task.result())
