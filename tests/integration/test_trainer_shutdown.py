"""``python -m vime_trainer`` on its own, stopped by a signal or ending by itself, leaves no Ray
process behind (raylet, GCS, ``ray::`` agents and workers — some of which sit outside its process
group, so only the trainer itself can stop them). Whether they outlive a trainer whose shutdown was
cut short depends on timing, so the tests also check the cause: Ray's own SIGTERM handler (abseil's,
which arms a 3-second abort) must not have fired, and a one-off run exits 128 + the signal.

The trainer and its Ray (Megatron ranks on the kit's nano model) are real. The rollout manager is a
stand-in served from this process: all a run needs from it here is one live engine in
``GET /v1/engines`` and POSTs that hang (the run then waits in start-up with its ranks up, for the
signal) or fail (the run ends by itself).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from test_cli_support import survivors

from vime import procs
from vime.launch.orphans import descendants
from vime.models.tiny import ensure_tiny_qwen3

TOKEN = "shutdown-token"
ENGINES = {
    "engines": [
        {
            "index": 0,
            "url": "http://127.0.0.1:9",
            "backend": "reference",
            "status": "ready",
            "registered": True,
        }
    ],
    "weight_version": 0,
    "health_monitor_paused": False,
    "update_lock_held": False,
}


@dataclass
class StandIn:
    """The stand-in rollout manager: POSTs are held until ``release`` (then 503), or fail at once."""

    url: str
    release: threading.Event
    posts: list[str]


@pytest.fixture
def rollout_stand_in(request: pytest.FixtureRequest) -> Iterator[StandIn]:
    hold = bool(getattr(request, "param", True))
    release, posts = threading.Event(), []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer(200, ENGINES) if self.path == "/v1/engines" else self._answer(404, {})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            posts.append(self.path)
            if hold:
                release.wait(300)
            self._answer(503, {"error": {"message": "stand-in"}})

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield StandIn(f"http://127.0.0.1:{server.server_address[1]}", release, posts)
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def _config(work: Path, stand_in: StandIn, redis_url: str) -> Path:
    cfg = {
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 2,
        "micro_batch_size": 2,
        "rollout_num_gpus": 0,
        "actor_num_gpus_per_node": 0,
        "actor_num_cpu_ranks": 1,
        "tensor_model_parallel_size": 1,
        "colocate": False,
        "output_dir": str(work / "runs"),
        "model": {"tiny_model_size": "nano"},
        "trainer": {"checkpoint_dir": str(work / "ckpt")},
        "services": {
            "rollout_url": stand_in.url,
            "trainer_port": procs.free_port(),
            "redis_url": redis_url,
            "api_token": TOKEN,
        },
    }
    path = work / "trainer.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Watch:
    """Every descendant the trainer had while it ran (pid -> command line), polled until it exits."""

    def __init__(self, child: procs.Child) -> None:
        self.child, self.seen = child, {}
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while self.child.alive():
            self.seen.update(descendants(self.child.pid))
            time.sleep(0.2)

    def ray(self) -> dict[int, str]:
        return {p: c for p, c in self.seen.items() if c.startswith("ray::") or "/ray/" in c}


def _start(work: Path, models: Path, *args: str) -> tuple[procs.Child, Watch]:
    argv = procs.python_module("vime_trainer", *args)
    child = procs.start("trainer", argv, log_path=work / "trainer.log", env={"VIME_MODEL_CACHE": str(models)})
    return child, Watch(child)


def _wait_for(predicate: Any, child: procs.Child, what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert child.alive(), f"the trainer exited before {what}:\n{child.log_tail(40)}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f}s:\n{child.log_tail(40)}"
        time.sleep(0.5)


def _ranks_up(events: Path) -> bool:
    return events.is_file() and '"trainer.start"' in events.read_text()


def _no_ray_left(watch: Watch, child: procs.Child) -> None:
    """The trainer is gone; so must be, within a few seconds, every Ray process it ever had."""
    seen = watch.ray()
    assert any("raylet" in c for c in seen.values()) and any(c.startswith("ray::") for c in seen.values()), (
        seen
    )
    deadline = time.monotonic() + 15
    while survivors(seen) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = survivors(seen)
    for pid in left:  # clean up before failing, so a regression does not leak into other tests
        os.kill(pid, signal.SIGKILL)
    assert not left, f"Ray processes outlived the trainer: {left}\n{child.log_tail(20)}"
    assert "SIGTERM received" not in child.log_tail(200)  # Ray's abseil handler stayed out of the way
    assert "Aborted" not in child.log_tail(200)


@pytest.fixture
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model cache, with the nano model built (else ``POST /v1/runs`` builds it and its 5 s
    client timeout may run out when this module runs on its own)."""
    cache = tmp_path_factory.getbasetemp() / "models"
    ensure_tiny_qwen3(cache, "nano")
    return cache


def test_sigterm_to_the_service_stops_its_ray(
    rollout_stand_in: StandIn, redis_url: str, tmp_path: Path, models: Path
) -> None:
    cfg = _config(tmp_path, rollout_stand_in, redis_url)
    port = yaml.safe_load(cfg.read_text())["services"]["trainer_port"]
    child, watch = _start(tmp_path, models, "--config", str(cfg))
    try:
        url = f"http://127.0.0.1:{port}"
        procs.wait_healthy(url, child, timeout_s=120)
        r = httpx.post(url + "/v1/runs", json={"run_id": "r"}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 201, r.text
        _wait_for(lambda: _ranks_up(tmp_path / "runs" / "r" / "events.jsonl"), child, "ranks")
        _wait_for(lambda: rollout_stand_in.posts, child, "a held POST")
        os.kill(child.pid, signal.SIGTERM)  # the process alone, as a service manager or `kill` would
        code = child.popen.wait(90)
    finally:
        child.stop()
    _no_ray_left(watch, child)
    assert code in (0, -signal.SIGTERM), child.log_tail(40)  # uvicorn re-raises the signal when done
    assert "cancelled (the trainer service is shutting down)" in child.log_tail(200)


@pytest.mark.parametrize(
    ("rollout_stand_in", "sig", "code"),
    [
        (True, signal.SIGTERM, 128 + signal.SIGTERM),
        (True, signal.SIGINT, 128 + signal.SIGINT),
        (False, None, 1),
    ],
    ids=["sigterm", "sigint", "run-ends"],
    indirect=["rollout_stand_in"],
)
def test_a_one_off_run_stops_its_ray_however_it_ends(
    rollout_stand_in: StandIn, redis_url: str, tmp_path: Path, models: Path, sig: int | None, code: int
) -> None:
    cfg = _config(tmp_path, rollout_stand_in, redis_url)
    child, watch = _start(tmp_path, models, "run", "--run-id", "once", "--config", str(cfg))
    try:
        if sig is not None:
            _wait_for(lambda: _ranks_up(tmp_path / "runs" / "once" / "events.jsonl"), child, "ranks")
            _wait_for(lambda: rollout_stand_in.posts, child, "a held POST")
            os.kill(child.pid, sig)
        returncode = child.popen.wait(180)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the run did not end:\n{child.log_tail(40)}") from None
    finally:
        child.stop()
    _no_ray_left(watch, child)
    assert returncode == code, child.log_tail(40)
    assert '"state": "failed"' in child.log_tail(200)  # the summary is printed on every way out
