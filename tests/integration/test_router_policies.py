"""Routing policies through the real router: consistent_hash on X-Session-ID (seed step 17) keeps a
session on one engine and spreads a dead engine's sessions over the others once it is taken out
(as the rollout manager takes out a dead engine); power_of_two spreads load over every engine.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.router_harness import (
    FakeEngineProcess,
    RouterProcess,
    start_fake_engines,
    start_router,
    stop_all,
)
from vime.clients.router import RouterClient, RouterDataClient

SAMPLING = {"max_tokens": 4, "temperature": 1.0, "top_p": 1.0, "logprobs": 1, "top_k": -1}


def start(
    logs: Path, policy: str, n: int, delay_s: float = 0.0
) -> tuple[RouterProcess, list[FakeEngineProcess]]:
    engines = start_fake_engines(n, logs, delay_s=delay_s)
    try:
        router = start_router(logs, overrides=[f"router.policy={policy}"])
    except Exception:
        stop_all(e.child for e in engines)
        raise
    for e in engines:
        router.register(e)
    return router, engines


async def engine_per_session(router: RouterProcess, sessions: list[str], repeats: int) -> dict[str, set[str]]:
    """Which engines answered each session id, over ``repeats`` rounds of concurrent requests."""
    seen: dict[str, set[str]] = {s: set() for s in sessions}
    async with RouterDataClient(router.data_url, retry_window_s=0) as client:
        for _ in range(repeats):
            outs = await asyncio.gather(
                *(client.generate([7, 8, 9], SAMPLING, session_id=s) for s in sessions)
            )
            for s, out in zip(sessions, outs, strict=True):
                seen[s].add(str(out["engine_id"]))
    return seen


@pytest.fixture(scope="module")
def consistent(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RouterProcess, list[FakeEngineProcess]]]:
    router, engines = start(tmp_path_factory.mktemp("ch"), "consistent_hash", 4)
    yield router, engines
    stop_all([router.child, *(e.child for e in engines)])


async def test_same_session_always_reaches_the_same_engine(
    consistent: tuple[RouterProcess, list[FakeEngineProcess]],
) -> None:
    router, engines = consistent
    sessions = [f"trajectory-{i}" for i in range(96)]
    seen = await engine_per_session(router, sessions, repeats=4)
    assert all(len(engines_) == 1 for engines_ in seen.values()), seen
    per_engine = Counter(next(iter(v)) for v in seen.values())
    assert set(per_engine) == {e.engine_id for e in engines}  # sessions spread over all 4
    for e in engines:  # and each engine saw each of its sessions 4 times, no others
        assert set(e.stats()["sessions"].values()) == {4}


async def test_dead_engines_sessions_spread_over_the_others_and_the_rest_stay(
    consistent: tuple[RouterProcess, list[FakeEngineProcess]],
) -> None:
    router, engines = consistent
    sessions = [f"sample-{i}" for i in range(160)]
    before = {s: next(iter(v)) for s, v in (await engine_per_session(router, sessions, 1)).items()}
    victim = engines[0]
    victim.child.kill()
    async with RouterClient(router.control_url) as control:
        assert await control.deregister(victim.engine_id)
    after = {s: next(iter(v)) for s, v in (await engine_per_session(router, sessions, 2)).items()}
    moved = [s for s in sessions if before[s] == victim.engine_id]
    stayed = [s for s in sessions if before[s] != victim.engine_id]
    assert len(moved) >= 10
    assert all(after[s] == before[s] for s in stayed)  # only the dead engine's sessions move
    landed = Counter(after[s] for s in moved)
    assert victim.engine_id not in landed
    assert len(landed) >= 2, landed  # spread, not piled onto the first healthy engine
    assert max(landed.values()) < len(moved)


async def test_power_of_two_spreads_load_over_all_engines(tmp_path: Path) -> None:
    router, engines = start(tmp_path, "power_of_two", 3, delay_s=0.3)
    try:
        async with RouterDataClient(router.data_url, retry_window_s=0) as client:
            outs = await asyncio.gather(*(client.generate([1, i], SAMPLING) for i in range(90)))
        load = Counter(str(o["engine_id"]) for o in outs)
        assert set(load) == {"e0", "e1", "e2"} and sum(load.values()) == 90
        assert min(load.values()) >= 15, load
    finally:
        stop_all([router.child, *(e.child for e in engines)])
