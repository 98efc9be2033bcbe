"""In-process stand-ins for the router data plane and the reward service, for the loop's unit tests.

`FakeGenerator` answers like vLLM's ``/inference/v1/generate`` (token ids, optional
``logprobs.content``, finish reason, usage) and records every request; `FakeScorer` scores with a
function of the sample. The integration tests use the real router, engines and reward service.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from vime.types import Sample


class FakeGenerator:
    """Replies after a short random delay; ``abort()`` makes in-flight requests finish with 'abort'."""

    def __init__(self, response_len: int = 3, delay_s: float = 0.002, seed: int = 0) -> None:
        self.response_len = response_len
        self.delay_s = delay_s
        self.rng = random.Random(seed)
        self.requests: list[tuple[dict[str, Any], str | None]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.abort_event = asyncio.Event()
        self.fail_next: list[BaseException | dict[str, Any]] = []
        self.hold_after: int | None = None
        """Requests after this many wait until `abort` (they then come back 'abort' with 1 token)."""

    async def abort(self) -> None:
        self.abort_event.set()

    async def generate(self, payload: dict[str, Any], *, session_id: str | None = None) -> dict[str, Any]:
        self.requests.append((payload, session_id))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.fail_next:
                item = self.fail_next.pop(0)
                if isinstance(item, BaseException):
                    raise item
                return item
            if self.hold_after is not None and len(self.requests) > self.hold_after:
                await self.abort_event.wait()
            else:
                await asyncio.sleep(self.delay_s * self.rng.random())
            sp = payload["sampling_params"]
            aborted = self.abort_event.is_set()
            n = 1 if aborted else min(self.response_len, sp["max_tokens"])
            tokens = [30 + (len(payload["token_ids"]) + k) % 10 for k in range(n)]
            return vllm_reply(tokens, "abort" if aborted else "stop", with_logprobs="logprobs" in sp)
        finally:
            self.in_flight -= 1


def vllm_reply(
    tokens: list[int], finish: str, with_logprobs: bool, version: str | None = None
) -> dict[str, Any]:
    """A vLLM 0.26-shaped generate reply (0.33 spans when ``version`` is given)."""
    choice: dict[str, Any] = {"index": 0, "token_ids": tokens, "finish_reason": finish, "logprobs": None}
    if with_logprobs:
        choice["logprobs"] = {"content": [{"token_id": t, "logprob": -0.5} for t in tokens]}
    if version is not None:
        choice["weight_versions"] = [{"version": version, "start": 0, "end": len(tokens)}]
    return {"choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": len(tokens)}}


class FakeScorer:
    """Scores each sample with ``fn(sample)``; records the size of every call."""

    def __init__(self, fn: Callable[[Sample], float]) -> None:
        self.fn = fn
        self.calls: list[int] = []

    async def score(self, samples: list[Sample]) -> list[tuple[float, dict[str, Any] | None]]:
        self.calls.append(len(samples))
        await asyncio.sleep(0)
        return [(float(self.fn(s)), {"status": "ok"}) for s in samples]
