"""Pause / resume / abort contract (seed steps 28, 46, 52): what happens to requests in flight and arriving."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from contract_support import EngineUnderTest, debug_state, greedy, until_running, wait_for

from vime.clients.base import ServiceCallError, ServiceUnreachable
from vime.clients.engine import EngineClient
from vime.wire.engine import engine_request_id
from vime.wire.vllm import GenerateResult

PROMPT = [12, 40, 7, 33, 21]
LONG = {"max_tokens": 4000, "temperature": 1.0, "seed": 8, "ignore_eos": True, "logprobs": 0}
HELD_S = 0.6


def _start(
    engine: EngineClient, sp: dict[str, object], request_id: str | None = None
) -> asyncio.Task[GenerateResult]:
    return asyncio.create_task(engine.generate(PROMPT, sp, request_id=request_id))


async def _arrival_during_pause(engine: EngineClient, eut: EngineUnderTest) -> asyncio.Task[GenerateResult]:
    """A request sent while paused: held until resume (0.26, reference) or refused with 503 (0.33)."""
    task = _start(engine, {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
    await asyncio.sleep(HELD_S)
    if eut.profile.holds_requests_in_abort_pause:
        assert not task.done(), "a request arriving during a pause must be held until resume"
    else:
        try:
            await task
        except ServiceCallError as exc:
            assert exc.status_code == 503
        else:
            raise AssertionError("vLLM 0.33 answers 503 to a request arriving during an abort/wait pause")
    return task


async def test_pause_abort_finishes_in_flight_requests_with_abort(
    engine: EngineClient, eut: EngineUnderTest
) -> None:
    in_flight = _start(engine, LONG)
    await until_running(eut, 1, min_tokens=5, tasks=[in_flight])
    await engine.pause("abort")
    aborted = await asyncio.wait_for(in_flight, 60)
    assert aborted.finish_reason == "abort"
    assert len(aborted.token_ids) < LONG["max_tokens"]
    assert aborted.log_probs is not None and len(aborted.log_probs) == len(aborted.token_ids)
    assert await engine.is_paused()
    arrival = await _arrival_during_pause(engine, eut)
    await engine.resume()
    if eut.profile.holds_requests_in_abort_pause:
        assert len((await asyncio.wait_for(arrival, 120)).token_ids) == 3


async def test_pause_wait_lets_running_requests_finish(engine: EngineClient, eut: EngineUnderTest) -> None:
    sp = {"max_tokens": 400, "temperature": 1.0, "seed": 2, "ignore_eos": True}
    in_flight = _start(engine, sp)
    await until_running(eut, 1, tasks=[in_flight])
    await engine.pause("wait")
    if eut.profile.reference:  # the engine itself says nothing is running any more
        assert (await debug_state(eut.url))["running"] == 0
    done = await asyncio.wait_for(in_flight, 10)  # already finished: only the response is in transit
    assert done.finish_reason == "length" and len(done.token_ids) == 400
    arrival = await _arrival_during_pause(engine, eut)
    await engine.resume()
    if eut.profile.holds_requests_in_abort_pause:
        assert (await asyncio.wait_for(arrival, 120)).finish_reason == "length"


async def test_pause_keep_freezes_and_resume_completes(engine: EngineClient, eut: EngineUnderTest) -> None:
    sp = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    uninterrupted = await greedy(engine, PROMPT, 400)
    in_flight = _start(engine, sp)
    await until_running(eut, 1, min_tokens=5, tasks=[in_flight])
    await engine.pause("keep")
    arrival = _start(engine, {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
    await asyncio.sleep(HELD_S)
    assert not in_flight.done() and not arrival.done(), "keep freezes running requests and holds new ones"
    await engine.resume()
    result = await asyncio.wait_for(in_flight, 120)
    assert result.finish_reason == "length" and len(result.token_ids) == 400
    if eut.profile.exact_numerics:  # recomputed after the pause, the greedy continuation is unchanged
        assert result.token_ids == uninterrupted
    assert len((await asyncio.wait_for(arrival, 120)).token_ids) == 3


async def test_abort_requests_by_id_and_all(engine: EngineClient, eut: EngineUnderTest) -> None:
    one = _start(engine, LONG, request_id="contract-abort-one")
    other = _start(engine, LONG, request_id="contract-abort-other")
    await until_running(eut, 2, tasks=[one, other])
    await engine.abort_requests([engine_request_id("contract-abort-one")])
    assert (await asyncio.wait_for(one, 60)).finish_reason == "abort"
    await asyncio.sleep(0.2)
    assert not other.done(), "aborting one request left the other running"
    third = _start(engine, LONG)
    await until_running(eut, 2, tasks=[other, third])
    await engine.abort_requests()  # no ids: everything tracked
    for task in (other, third):
        assert (await asyncio.wait_for(task, 60)).finish_reason == "abort"
    assert not await engine.is_paused()  # aborting is not pausing: new requests run
    assert len(await greedy(engine, PROMPT, 4)) == 4


async def test_client_disconnect_aborts_its_request(engine: EngineClient, eut: EngineUnderTest) -> None:
    impatient = EngineClient(eut.url, timeout=0.5, retries=0)
    try:
        with pytest.raises((httpx.TimeoutException, ServiceUnreachable)):
            await impatient.generate(PROMPT, LONG)
    finally:
        await impatient.aclose()
    if eut.profile.reference:  # the engine stopped decoding for the client that left

        async def idle() -> bool:
            return (await debug_state(eut.url))["requests"] == 0

        await wait_for(idle, timeout=10)
    assert len(await greedy(engine, PROMPT, 4)) == 4
