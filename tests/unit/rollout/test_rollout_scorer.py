"""Scoring at the reward service (seed step 26): per sample, coalesced on the wire; per group with
group_rm; an empty response is scored, not refused. The reward service is an httpx mock here."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest
from vime_rollout.scorer import RewardScorer

from vime.clients.base import ServiceCallError
from vime.clients.reward import RewardClient
from vime.types import Sample


class FakeRewardService:
    """Scores ``len(response)``; records each call's path and item count."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, int, bool]] = []
        self.fail = fail
        self.bodies: list[dict[str, Any]] = []

    async def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        await asyncio.sleep(0.01)  # on the wire for a while: later requests queue up meanwhile
        if self.fail:
            return httpx.Response(422, json={"error": {"message": "label: missing"}})
        if request.url.path == "/v1/reward":
            self.calls.append(("one", 1, False))
            return httpx.Response(200, json=self._result(body))
        self.calls.append(("batch", len(body["items"]), body["group"]))
        return httpx.Response(200, json={"results": [self._result(i) for i in body["items"]]})

    @staticmethod
    def _result(item: dict[str, Any]) -> dict[str, Any]:
        return {"reward": float(len(item["response"])), "fn": "len", "pred": item["response"][:3]}


def _scorer(service: FakeRewardService, group_rm: bool = False) -> RewardScorer:
    client = RewardClient("http://reward", transport=httpx.MockTransport(service.handler), retries=0)
    return RewardScorer(client, fn=None, group_rm=group_rm)


def _sample(text: str, label: Any = 1) -> Sample:
    s = Sample(prompt="p", label=label, tokens=[1, 2])
    s.append_response_tokens([3] * max(1, len(text)), text=text)
    return s


def test_per_sample_scores_are_coalesced_and_matched() -> None:
    service = FakeRewardService()

    async def main() -> list[Any]:
        scorer = _scorer(service)
        try:
            texts = ["x" * k for k in range(40)]
            return await asyncio.gather(*(scorer.score([_sample(t)]) for t in texts))
        finally:
            await scorer.aclose()

    results = asyncio.run(main())
    assert [r[0][0] for r in results] == [float(k) for k in range(40)]
    assert results[3][0][1] == {"status": "ok", "fn": "len", "pred": "xxx"}
    assert sum(n for _, n, _ in service.calls) == 40
    assert len(service.calls) < 40 and all(not group for _, _, group in service.calls)


def test_group_rm_is_one_group_call() -> None:
    service = FakeRewardService()

    async def main() -> Any:
        scorer = _scorer(service, group_rm=True)
        try:
            return await scorer.score([_sample("a" * k) for k in range(8)])
        finally:
            await scorer.aclose()

    out = asyncio.run(main())
    assert [r for r, _ in out] == [float(k) for k in range(8)]
    assert service.calls == [("batch", 8, True)]


def test_empty_text_is_sent_as_text_and_errors_reach_every_waiter() -> None:
    service = FakeRewardService()

    async def main() -> None:
        scorer = _scorer(service)
        try:
            ((reward, _),) = await scorer.score([_sample("")])
            assert reward == 0.0
            assert (
                service.bodies[-1]["response"] == "" and service.bodies[-1].get("response_token_ids") is None
            )
            service.fail = True
            outcomes = await asyncio.gather(
                *(scorer.score([_sample("ab")]) for _ in range(5)), return_exceptions=True
            )
            assert all(isinstance(o, ServiceCallError) and "label: missing" in str(o) for o in outcomes)
        finally:
            await scorer.aclose()

    asyncio.run(main())


def test_a_short_answer_fails_loudly() -> None:
    async def short(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"results": [{"reward": 1.0, "fn": "f"}]})

    client = RewardClient("http://reward", transport=httpx.MockTransport(short), retries=0)
    scorer = RewardScorer(client, fn=None, group_rm=True)
    with pytest.raises(RuntimeError, match="1 results for 2 samples"):
        asyncio.run(scorer.score([_sample("a"), _sample("b")]))


def test_a_stalled_reward_service_is_named_in_warnings_and_waited_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call unanswered for stall_warning_s is a warning (again while it lasts), and so is its end."""
    service = FakeRewardService()
    handler = service.handler

    async def stalled(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.35)
        return await handler(request)

    client = RewardClient("http://reward", transport=httpx.MockTransport(stalled), retries=0)
    scorer = RewardScorer(client, fn=None, group_rm=False, stall_warning_s=0.1)

    async def go() -> list[tuple[float, Any]]:
        try:
            return await scorer.score([_sample("abc")])
        finally:
            await scorer.aclose()

    with caplog.at_level("WARNING", logger="vime.rollout.reward"):
        assert asyncio.run(go())[0][0] == 3.0
    stalls = [r.getMessage() for r in caplog.records if "reward service stalled" in r.getMessage()]
    assert len(stalls) >= 2 and "http://reward" in stalls[0] and "reward.request_timeout_s" in stalls[0]
    assert "answered again after a" in caplog.records[-1].getMessage()


def test_the_wait_for_a_stalled_reward_service_is_bounded() -> None:
    """A service that takes the connection and never answers (a stopped process): the client's
    timeout (reward.request_timeout_s) ends the wait with an error, which fails the rollout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()  # the kernel accepts; nobody ever reads or answers
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        client = RewardClient(url, timeout=0.3, retry_budget_s=0.3)
        scorer = RewardScorer(client, fn=None, group_rm=True, stall_warning_s=0.1)

        async def go() -> None:
            try:
                await scorer.score([_sample("abc")])
            finally:
                await scorer.aclose()

        with pytest.raises(httpx.ReadTimeout):
            asyncio.run(go())
