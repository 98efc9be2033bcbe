"""Typed async client of the reward service (used by the rollout manager, seed step 26).

Every call carries a ``sample_id`` (a fresh one when the caller gives none), so the base client's
retries after a dropped connection are answered from the service's idempotency cache instead of
scoring again. Error statuses raise `ServiceCallError`; no answer after the last retry raises
`ServiceUnreachable`.

It stays on httpx (`ServiceClient`), unlike the router's data-plane client: the rollout manager
coalesces per-sample scores into batches (`vime_rollout.scorer`), about 30 calls per 256-sample
rollout, so aiohttp's saving (about 0.9 ms of client CPU per call) is a few percent of the
manager's CPU and does not show in ``bench/rollout_overhead.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from vime.clients.base import ServiceClient
from vime.retry import RetryPolicy
from vime.types import Sample
from vime.wire.reward import (
    RewardBatchRequest,
    RewardBatchResult,
    RewardFunctionList,
    RewardRequest,
    RewardResult,
    request_from_sample,
)

SampleLike = RewardRequest | Sample | Mapping[str, Any]


def to_request(
    item: SampleLike, fn: str | None = None, options: Mapping[str, Any] | None = None
) -> RewardRequest:
    """A `RewardRequest` from a request, a `Sample` or a plain mapping; fn/options fill what is unset."""
    if isinstance(item, Sample):
        req = request_from_sample(item, fn=fn, options=dict(options or {}))
    elif isinstance(item, RewardRequest):
        req = item.model_copy()
    else:
        req = RewardRequest.model_validate(dict(item))
    updates: dict[str, Any] = {}
    if req.fn is None and fn is not None:
        updates["fn"] = fn
    if options and not req.options:
        updates["options"] = dict(options)
    if req.sample_id is None:
        updates["sample_id"] = uuid.uuid4().hex
    return req.model_copy(update=updates) if updates else req


class RewardClient(ServiceClient):
    """``await client.score(sample)`` → `RewardResult`; ``score_batch`` for many samples or a group."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | None = 300.0,
        retry_budget_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        """``retry_budget_s``: retry a call that found no service (restarting) for this long
        instead of the base client's few attempts."""
        super().__init__(base_url, timeout=timeout, **kwargs)
        if retry_budget_s is not None:
            self.retry = RetryPolicy(attempts=None, budget_s=retry_budget_s, backoff_s=0.2, max_backoff_s=2.0)

    async def score(
        self, item: SampleLike, *, fn: str | None = None, options: Mapping[str, Any] | None = None
    ) -> RewardResult:
        """Score one sample."""
        req = to_request(item, fn, options)
        body = await self.request("POST", "/v1/reward", json=req.model_dump(mode="json"), idempotent=True)
        return RewardResult.model_validate(body)

    async def score_batch(
        self,
        items: Sequence[SampleLike],
        *,
        fn: str | None = None,
        options: Mapping[str, Any] | None = None,
        group: bool = False,
    ) -> list[RewardResult]:
        """Score many samples in one call (``group=True``: one call of a user function for all)."""
        batch = RewardBatchRequest(items=[to_request(item, fn, options) for item in items], group=group)
        body = await self.request("POST", "/v1/rewards", json=batch.model_dump(mode="json"), idempotent=True)
        return RewardBatchResult.model_validate(body).results

    async def functions(self) -> RewardFunctionList:
        """The reward functions the service knows and what each expects."""
        return RewardFunctionList.model_validate(await self.request("GET", "/v1/reward-functions"))

    async def health(self) -> dict[str, Any]:
        """The service's /health body (pool size, busy and restarted workers)."""
        body = await self.request("GET", "/health", idempotent=True)
        return dict(body)
