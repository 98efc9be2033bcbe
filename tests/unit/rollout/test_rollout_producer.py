"""The async mode's producer over the REST API (stub engines, in-process router/reward stand-ins,
real Redis): it runs ahead of the trainer by at most ``max_staleness`` batches, waits while
admission is paused, and a stop leaves the data source right after what it published."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from rollout_fakes import FakeGenerator, StubWorld, manager_starter, small_config
from vime_rollout.app import build_app
from vime_rollout.batch_builder import BatchSink
from vime_rollout.data import DataSource, build_dataset
from vime_rollout.data.synthetic import arithmetic_records

from vime.config import RunConfig
from vime.queue import BatchConsumer, connect
from vime.queue_waiting import drop, waiting_entries
from vime.wire.rollout import PRODUCER_NEXT_KEY

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
START = {"first_rollout_id": 0, "end_rollout_id": 3, "dp_size": 2, "max_staleness": 1}


def _cfg(mode: str) -> RunConfig:
    return small_config(mode=mode, colocate=False)


def _app(cfg: RunConfig, tokenizer: Any, redis_url: str, run_id: str) -> Any:
    world = StubWorld()
    train = build_dataset(
        "a",
        arithmetic_records(40, 1),
        tokenizer,
        input_key="prompt",
        label_key="label",
        metadata_key="metadata",
        apply_chat_template=False,
        max_prompt_len=64,
    )

    start = manager_starter(
        cfg,
        tokenizer,
        world,
        engines=1,
        run_id=run_id,
        generator=FakeGenerator(),
        train_data=DataSource(train, cfg.n_samples_per_prompt, seed=1),
        eval_data={},
        sink=BatchSink(redis_url, run_id),
    )
    return build_app(start, token=TOKEN, default_dp_size=cfg.dp_size)


@pytest.fixture
def producer(tokenizer: Any, redis_url: str) -> Iterator[tuple[TestClient, str]]:
    run_id = f"p-{uuid.uuid4().hex[:8]}"
    with TestClient(_app(_cfg("async"), tokenizer, redis_url, run_id)) as c:
        yield c, run_id


def _until(c: TestClient, check: Any, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = c.get("/v1/producer").json()
        if check(status):
            return dict(status)
        time.sleep(0.05)
    raise AssertionError(f"producer never got there: {c.get('/v1/producer').json()}")


async def _take(redis_url: str, run_id: str) -> list[str]:
    """What the trainer's ranks do when they start training the next batch: read it."""
    got = []
    for rank in range(2):
        async with BatchConsumer(redis_url, run_id, rank, f"trainer-rank{rank}") as consumer:
            share = await consumer.next()
            assert share is not None
            got.append(share.batch_id)
    return got


async def _waiting(redis_url: str, run_id: str) -> list[int]:
    r = connect(redis_url)
    try:
        return [e.rollout_id for e in await waiting_entries(r, run_id)]
    finally:
        await r.aclose()


async def _drop(redis_url: str, run_id: str, batch_id: str) -> None:
    r = connect(redis_url)
    try:
        await drop(r, run_id, [batch_id])
    finally:
        await r.aclose()


def test_a_sync_manager_has_no_producer(tokenizer: Any, redis_url: str) -> None:
    with TestClient(_app(_cfg("sync"), tokenizer, redis_url, "p-sync")) as c:
        r = c.post("/v1/producer/start", json=START, headers=AUTH)
        assert r.status_code == 409 and "mode=sync" in r.json()["error"]["message"]
        assert c.get("/v1/engines").json()["mode"] == "sync"


def test_the_producer_runs_at_most_max_staleness_batches_ahead(producer: Any, redis_url: str) -> None:
    c, run_id = producer
    assert c.post("/v1/producer/start", json=START).status_code == 401
    assert c.post("/v1/producer/start", json={**START, "max_staleness": 0}, headers=AUTH).status_code == 422
    started = c.post("/v1/producer/start", json=START, headers=AUTH)
    assert started.status_code == 200 and started.json()["run_id"] == run_id
    first = _until(c, lambda s: s["published"] == 1)
    time.sleep(0.5)  # room for one batch only: it waits untaken, so rollout 1 does not start
    assert c.get("/v1/producer").json() | {"generating_s": 0} == first | {"generating_s": 0}
    assert (first["waiting"], first["next_rollout_id"], first["running"]) == (1, 1, True)
    assert asyncio.run(_waiting(redis_url, run_id)) == [0]
    refused = c.post("/v1/rollouts", json={"rollout_id": 5}, headers=AUTH)
    assert refused.status_code == 409 and "producer is running" in refused.json()["error"]["message"]
    assert c.post("/v1/producer/start", json=START, headers=AUTH).status_code == 409
    assert c.put("/v1/data-source/state", json={"state": {}}, headers=AUTH).status_code == 409
    assert asyncio.run(_take(redis_url, run_id)) == [f"{run_id}:0:0"] * 2  # the trainer takes rollout 0
    _until(c, lambda s: s["published"] == 2)
    asyncio.run(_drop(redis_url, run_id, f"{run_id}:1:0"))  # the trainer drops rollout 1: room again
    done = _until(c, lambda s: not s["running"])
    assert (done["published"], done["next_rollout_id"], done["error"]) == (3, 3, None)
    assert done["generating_s"] > 0 and asyncio.run(_waiting(redis_url, run_id)) == [2]
    state = c.get("/v1/data-source/state").json()["state"]
    assert state[PRODUCER_NEXT_KEY] == 3 and state["sample_group_index"] == 6  # 3 rollouts × 2 prompts


def test_admission_holds_the_producer_and_a_stop_gives_the_rollout_under_way_back(
    producer: Any, redis_url: str
) -> None:
    c, run_id = producer
    assert c.post("/v1/admission/pause", headers=AUTH).json()["paused"]
    c.post("/v1/producer/start", json={**START, "max_staleness": 3}, headers=AUTH)
    time.sleep(0.5)
    held = c.get("/v1/producer").json()
    assert (held["published"], held["generating"], held["running"]) == (0, False, True)
    c.post("/v1/admission/resume", json={"was_paused": False}, headers=AUTH)
    _until(c, lambda s: s["published"] >= 1)
    stopped = c.post("/v1/producer/stop", headers=AUTH).json()
    assert not stopped["running"]
    state = c.get("/v1/data-source/state").json()["state"]
    published = stopped["published"]
    assert state[PRODUCER_NEXT_KEY] == published and state["sample_group_index"] == 2 * published
    assert len(asyncio.run(_waiting(redis_url, run_id))) == published
    assert c.post("/v1/producer/stop", headers=AUTH).status_code == 200  # idempotent
