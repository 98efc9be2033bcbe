"""The trainer's REST surface: auth, one active run (409), bad configs (422 naming the field), unknown
runs (404), stop (202), requests without an active run (409), /health and /metrics.

The run started here waits for a rollout manager that is not there, which is enough to hold it
active; the app's shutdown cancels it and its trainer backend is shut down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import Response
from fastapi.testclient import TestClient
from trainer_fakes import FakeBackend
from vime_trainer.app import _served, build_app
from vime_trainer.runs import RunRegistry
from vime_trainer.state import RunEnded

from vime import procs
from vime.config import load_config
from vime.service import ServiceError
from vime.wire.trainer import RunPhase

TOKEN = "unit-trainer-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def app_client(tmp_path: Path) -> Iterator[tuple[TestClient, list[FakeBackend]]]:
    dead = f"http://127.0.0.1:{procs.free_port()}"  # nothing listens: the run stays in start-up
    base = [
        "rollout_num_gpus=0",
        "actor_num_gpus_per_node=0",
        "tensor_model_parallel_size=1",
        "rollout_batch_size=2",
        "n_samples_per_prompt=4",
        "micro_batch_size=4",
        f"output_dir={tmp_path / 'runs'}",
        f"services.rollout_url={dead}",
        "services.redis_url=redis://127.0.0.1:1/0",
    ]
    backends: list[FakeBackend] = []

    def factory(cfg: Any) -> FakeBackend:
        backends.append(FakeBackend())
        return backends[-1]

    registry = RunRegistry(lambda extra: load_config(None, [*base, *extra], environ={}), factory)
    with TestClient(build_app(registry, token=TOKEN)) as client:
        yield client, backends
    assert all("shutdown" in b.calls for b in backends)


def test_runs_need_the_token_and_a_valid_config(app_client: Any) -> None:
    client, _ = app_client
    assert client.post("/v1/runs", json={}).status_code == 401
    r = client.post("/v1/runs", json={"config": {"rollout_batch_size": 0}}, headers=AUTH)
    assert r.status_code == 422 and "rollout_batch_size" in r.json()["error"]["message"]
    r = client.post("/v1/runs", json={"config": {"tensor_model_parallel_size": 2}}, headers=AUTH)
    assert r.status_code == 422 and "does not divide the 1 training ranks" in r.json()["error"]["message"]
    r = client.post("/v1/runs", json={"config": {"no_such_field": 1}}, headers=AUTH)
    assert r.status_code == 422 and "no_such_field" in r.json()["error"]["message"]
    for bad in ("../x", "..", "."):
        r = client.post("/v1/runs", json={"run_id": bad}, headers=AUTH)
        assert r.status_code == 422 and "run_id" in r.json()["error"]["message"]
    r = client.post("/v1/runs", json={"confg": {}}, headers=AUTH)
    assert r.status_code == 422 and "confg" in r.json()["error"]["message"]


def test_a_resume_needs_a_checkpoint_and_no_start_rollout_id(app_client: Any) -> None:
    client, backends = app_client
    r = client.post("/v1/runs", json={"run_id": "fresh", "resume": True}, headers=AUTH)
    assert r.status_code == 409 and "no checkpoint" in r.json()["error"]["message"], r.text
    body = {"run_id": "fresh", "resume": True, "config": {"start_rollout_id": 3}}
    r = client.post("/v1/runs", json=body, headers=AUTH)
    assert r.status_code == 422 and "start_rollout_id" in r.json()["error"]["message"]
    assert backends == []  # refused before any trainer was built


def test_one_active_run_its_status_events_and_stop(app_client: Any) -> None:
    client, _ = app_client
    r = client.post("/v1/runs", json={"run_id": "a", "config": {"num_rollout": 3}}, headers=AUTH)
    assert r.status_code == 201, r.text
    status = r.json()
    assert (status["run_id"], status["state"], status["phase"], status["num_rollout"]) == (
        "a",
        "running",
        "starting",
        3,
    )
    second = client.post("/v1/runs", json={"run_id": "b"}, headers=AUTH)
    assert second.status_code == 409 and "one active run" in second.json()["error"]["message"]
    assert client.get("/v1/runs/a").json()["run_id"] == "a"
    assert client.get("/v1/runs/zzz").status_code == 404
    listed = client.get("/v1/runs").json()
    assert listed["active"] == "a" and [s["run_id"] for s in listed["runs"]] == ["a"]
    assert client.get("/health").json()["active_run"] == "a"
    events = client.get("/v1/runs/a/events").json()["events"]
    assert events and events[0]["action"] == "run.start" and events[0]["detail"]["num_rollout"] == 3
    assert client.post("/v1/weights/push", json={"wait": "x"}, headers=AUTH).status_code == 422
    assert client.post("/v1/runs/a/stop").status_code == 401
    stopped = client.post("/v1/runs/a/stop", headers=AUTH)
    assert stopped.status_code == 202 and stopped.json()["state"] == "stopping"


def test_a_run_may_change_only_what_it_applies(app_client: Any, tmp_path: Path) -> None:
    """Issue 17: ``/v1/runs`` took rollout-side fields the rollout manager never applies (so the
    trainer's config no longer described its batches) and output paths anywhere on disk. Those are
    refused, 422 naming each field; the run's own fields still go through."""
    client, backends = app_client
    for config, named in [
        ({"n_samples_per_prompt": 4}, ["n_samples_per_prompt"]),
        ({"rollout_batch_size": 4, "micro_batch_size": 2}, ["micro_batch_size", "rollout_batch_size"]),
        (
            {"reward": {"rm_type": "f1"}, "data": {"prompt_data": "x.jsonl"}},
            ["data.prompt_data", "reward.rm_type"],
        ),
        ({"services": {"redis_url": "redis://elsewhere:6379/0"}}, ["services.redis_url"]),
        ({"trainer": {"weight_dir": str(tmp_path)}}, ["trainer.weight_dir"]),
    ]:
        r = client.post("/v1/runs", json={"config": config}, headers=AUTH)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["fields"] == named and err["message"].startswith(
            f"config: {', '.join(named)} cannot change"
        )
    outside = [
        ({"output_dir": "/etc"}, "config.output_dir"),
        ({"output_dir": str(tmp_path / "runs" / ".." / "elsewhere")}, "config.output_dir"),
        ({"trainer": {"checkpoint_dir": str(tmp_path)}}, "config.trainer.checkpoint_dir"),
        ({"start_rollout_id": 2**60}, "config.start_rollout_id"),
        ({"run_id": ".."}, "config.run_id"),  # it names <checkpoint_dir>/<run_id>
    ]
    for config, field in outside:
        r = client.post("/v1/runs", json={"config": config}, headers=AUTH)
        assert r.status_code == 422 and r.json()["error"]["message"].startswith(f"{field}: "), r.text
    assert backends == []  # nothing refused got as far as building a trainer
    inside = {"output_dir": str(tmp_path / "runs" / "mine"), "num_rollout": 2, "trainer": {"lr": 1e-4}}
    r = client.post("/v1/runs", json={"run_id": "ok", "config": inside}, headers=AUTH)
    assert r.status_code == 201, r.text


def test_push_and_checkpoint_answer_at_once_when_the_run_cannot_serve_them(app_client: Any) -> None:
    """Issue 17: a push during start-up blocked for more than 30 s, a checkpoint racing a stop got
    a 502. While the run starts up or stops, both are a 409 saying why, at once (waiting or not)."""
    client, _ = app_client
    assert client.post("/v1/runs", json={"run_id": "w"}, headers=AUTH).status_code == 201  # stays starting
    for path in ("/v1/weights/push", "/v1/checkpoints"):
        for body in ({}, {"wait": False}):
            r = client.post(path, json=body, headers=AUTH)
            assert r.status_code == 409 and "is starting up (phase starting)" in r.json()["error"]["message"]
    registry = client.app.state.registry  # type: ignore[attr-defined]
    registry.active.ctx.set_phase(RunPhase.ROLLOUT)  # as if start-up were done
    registry.active.ctx.request_stop()
    for path in ("/v1/weights/push", "/v1/checkpoints"):
        r = client.post(path, json={}, headers=AUTH)
        assert r.status_code == 409 and "run w is stopping" in r.json()["error"]["message"], r.text


async def test_a_request_the_run_ended_before_serving_is_409_not_502() -> None:
    """The race of issue 17: a checkpoint asked for just before the run ended. The run's last
    checkpoint is its own answer; the request is a 409 saying it ended, not a gateway error."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[Any] = loop.create_future()
    ended.set_exception(RunEnded("the run ended before serving the request: run stopped"))
    with pytest.raises(ServiceError) as err:
        await _served(ended, None, Response(), "r", "checkpoint", "checkpoint")
    assert err.value.status_code == 409 and "run ended before serving" in err.value.message
    failed: asyncio.Future[Any] = loop.create_future()
    failed.set_exception(RuntimeError("no live engine to push to"))
    with pytest.raises(ServiceError) as err:
        await _served(failed, None, Response(), "r", "weights.push", "weight push")
    assert err.value.status_code == 502


async def test_the_shutdown_after_a_signal_lets_the_run_finish_its_clean_up() -> None:
    """A signal cancels the run at once; the service's shutdown that follows cancels again. The
    second must not cut the first's clean-up (where the last step is checkpointed) half-way."""
    started, saved = asyncio.Event(), asyncio.Event()

    async def run() -> None:
        try:
            started.set()
            await asyncio.sleep(3600)  # a rollout
        finally:
            await asyncio.sleep(0.1)  # the checkpoint of the last step
            saved.set()

    registry = RunRegistry(lambda extra: None, lambda cfg: None)  # type: ignore[arg-type,return-value]
    handle = SimpleNamespace(task=asyncio.create_task(run()))
    registry.active = handle  # type: ignore[assignment]
    await started.wait()
    registry.cancel()  # the signal
    await asyncio.sleep(0)
    await registry.aclose()  # the lifespan's end
    assert saved.is_set() and handle.task.cancelled()


def test_stop_while_waiting_for_the_rollout_manager_ends_the_run(app_client: Any) -> None:
    client, backends = app_client
    client.post("/v1/runs", json={"run_id": "s"}, headers=AUTH)
    client.post("/v1/runs/s/stop", headers=AUTH)
    for _ in range(100):
        status = client.get("/v1/runs/s").json()
        if status["state"] not in ("running", "stopping"):
            break
        import time

        time.sleep(0.1)
    assert status["state"] == "stopped" and status["steps_done"] == 0 and status["summary"]["steps"] == 0
    assert backends[0].calls == ["shutdown"]  # never started, nothing trained, nothing saved
    assert client.post("/v1/runs/s/stop", headers=AUTH).status_code == 409
    assert client.post("/v1/weights/push", json={}, headers=AUTH).status_code == 409
    assert client.post("/v1/checkpoints", json={}, headers=AUTH).status_code == 409
    # The next run may start now.
    assert client.post("/v1/runs", json={"run_id": "t"}, headers=AUTH).status_code == 201


def test_metrics_expose_the_trainer_gauges(app_client: Any) -> None:
    client, _ = app_client
    text = client.get("/metrics").text
    assert "vime_trainer_weight_version" in text and "vime_trainer_phase_seconds" in text
