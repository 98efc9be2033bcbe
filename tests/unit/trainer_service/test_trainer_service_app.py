"""The trainer's REST surface: auth, one active run (409), bad configs (422 naming the field), unknown
runs (404), stop (202), requests without an active run (409), /health and /metrics.

The run started here waits for a rollout manager that is not there, which is enough to hold it
active; the app's shutdown cancels it and its trainer backend is shut down.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from trainer_fakes import FakeBackend
from vime_trainer.app import build_app
from vime_trainer.runs import RunRegistry

from vime import procs
from vime.config import load_config

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
    r = client.post("/v1/runs", json={"config": {"micro_batch_size": 5}}, headers=AUTH)
    assert r.status_code == 422 and "global_batch_size" in r.json()["error"]["message"]
    r = client.post("/v1/runs", json={"config": {"no_such_field": 1}}, headers=AUTH)
    assert r.status_code == 422 and "no_such_field" in r.json()["error"]["message"]
    r = client.post("/v1/runs", json={"run_id": "../x"}, headers=AUTH)
    assert r.status_code == 422 and "run_id" in r.json()["error"]["message"]
    r = client.post("/v1/runs", json={"confg": {}}, headers=AUTH)
    assert r.status_code == 422 and "confg" in r.json()["error"]["message"]


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
    assert client.post("/v1/runs/a/stop").status_code == 401
    stopped = client.post("/v1/runs/a/stop", headers=AUTH)
    assert stopped.status_code == 202 and stopped.json()["state"] == "stopping"
    accepted = client.post("/v1/weights/push", json={"wait": False}, headers=AUTH)
    assert accepted.status_code == 202 and accepted.json() == {"run_id": "a", "accepted": "weights.push"}
    assert client.post("/v1/weights/push", json={"wait": "x"}, headers=AUTH).status_code == 422


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
