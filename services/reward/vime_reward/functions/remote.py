"""``remote``: forward the sample to another reward server (a reward model served elsewhere).

The sample is POSTed as JSON ``{prompt, response, label, metadata, sample_id, ...}`` (slime's
remote_rm body, and a valid request for another vime reward service's ``/v1/reward``); the reply
is a number or an object holding the reward under ``reward_key`` / ``reward`` / ``score``. It only
waits on the network, so it runs in the service's event loop, not in the worker pool. Each attempt
has a timeout; connection failures and 502/503/504 are retried with backoff.

Each forward carries ``X-Vime-Reward-Hops`` (the count it arrived with, plus one), so a chain of
reward services that loops back on itself (a ``remote_url`` pointing at a service whose default
is ``remote`` again) ends with an error after `MAX_HOPS` forwards instead of spawning requests
until every timeout fires.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field

from vime.clients.base import ServiceClient, ServiceUnreachable, error_message
from vime.wire.reward import RewardRequest
from vime_reward.functions.base import Outcome, as_outcome, clip

HOPS_HEADER = "X-Vime-Reward-Hops"
MAX_HOPS = 4
"""Forwards a sample may take through reward services; more is taken for a loop."""
arrived_hops: ContextVar[int] = ContextVar("arrived_hops", default=0)
"""The hop count of the request being served (set by the routes from `HOPS_HEADER`)."""


def hops_of(value: str | None) -> int:
    """The hop count in a request header (a malformed value counts as one hop)."""
    if value is None:
        return 0
    try:
        return max(0, int(value))
    except ValueError:
        return 1


class RemoteOptions(BaseModel):
    """Where to send the sample and how long to wait."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(None, pattern=r"^https?://[^/\s]+(/\S*)?$")
    """Reward server URL; defaults to reward.remote_url of the service config."""
    timeout_s: float | None = Field(None, gt=0, le=3600)
    """Timeout of one attempt; defaults to reward.timeout_s."""
    retries: int = Field(3, ge=0, le=10)
    """Extra attempts after a connection failure or a 502/503/504."""
    reward_key: str | None = None
    """Field of an object reply that holds the reward (default: 'reward', else 'score')."""


class RemoteTimeout(Exception):
    """The remote server did not answer within the timeout."""


class RemoteFailed(Exception):
    """The remote server could not be reached, or answered with an error."""


class RemoteScorer:
    """Pooled connections to remote reward servers, one client per origin."""

    def __init__(self, default_url: str | None, default_timeout_s: float) -> None:
        self.default_url = default_url
        self.default_timeout_s = default_timeout_s
        self._clients: dict[str, ServiceClient] = {}

    def _client(self, origin: str) -> ServiceClient:
        if origin not in self._clients:
            # No bearer token: the URL may come from a request and must not receive our credentials.
            self._clients[origin] = ServiceClient(origin, timeout=None, backoff_s=0.2)
        return self._clients[origin]

    async def score(self, req: RewardRequest, opts: RemoteOptions) -> Outcome:
        """The remote server's reward for ``req``."""
        url = opts.url or self.default_url
        if not url:
            raise RemoteFailed("remote needs options.url or reward.remote_url in the service config")
        hops = arrived_hops.get()
        if hops >= MAX_HOPS:
            raise RemoteFailed(
                f"not forwarded: the sample already came through {hops} reward services "
                f"(a loop? check reward.remote_url of each, last {url})"
            )
        parts = urlsplit(url)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        body = req.model_dump(mode="json", exclude={"fn", "options"}, exclude_none=True)
        body.setdefault("label", None)
        timeout = opts.timeout_s or self.default_timeout_s
        try:
            resp = await self._client(f"{parts.scheme}://{parts.netloc}").send(
                "POST",
                path,
                json=body,
                headers={HOPS_HEADER: str(hops + 1)},
                timeout=timeout,
                idempotent=True,
                retries=opts.retries,
            )
        except httpx.TimeoutException as exc:
            raise RemoteTimeout(f"{url} did not answer within {timeout:g}s") from exc
        except (ServiceUnreachable, httpx.HTTPError) as exc:
            raise RemoteFailed(str(exc)) from exc
        if resp.status_code != 200:
            raise RemoteFailed(f"{url} answered {resp.status_code}: {error_message(resp)}")
        try:
            reply: Any = resp.json()
        except ValueError as exc:
            raise RemoteFailed(f"{url} answered with non-JSON: {clip(resp.text[:200])}") from exc
        return _reply_outcome(reply, opts.reward_key)

    async def aclose(self) -> None:
        """Close every pooled connection."""
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


def _reply_outcome(reply: Any, reward_key: str | None) -> Outcome:
    """An `Outcome` from the remote reply; a vime reply's timeout/error status carries over."""
    try:
        return _parse_reply(reply, reward_key)
    except (TypeError, ValueError) as exc:
        raise RemoteFailed(f"the remote reply is not a reward: {exc}") from exc


def _parse_reply(reply: Any, reward_key: str | None) -> Outcome:
    if isinstance(reply, dict):
        status = reply.get("status")
        if status == "timeout":
            raise RemoteTimeout(f"the remote reward server timed out: {reply.get('error') or ''}".strip())
        if status == "error":
            raise RemoteFailed(f"the remote reward server failed: {reply.get('error')}")
        if reward_key is not None:
            if reward_key not in reply:
                raise RemoteFailed(f"the remote reply has no {reward_key!r} (keys: {sorted(reply)[:10]})")
            reply = {**reply, "reward": reply[reward_key]}
        outcome = as_outcome({k: v for k, v in reply.items() if k in ("reward", "score", "pred", "details")})
        extra = reply.get("details")
        outcome.details = dict(extra) if isinstance(extra, dict) else {}
        return outcome
    return as_outcome(reply)
