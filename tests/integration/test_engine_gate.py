"""An engine the rollout manager starts is reachable only through its gate: reads and generate are
open on its port, control routes need the stack's token, and the engine itself listens on a Unix
socket in a directory only this user can enter (the real launcher, reference engine and Caddy)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from vime_rollout.engines.commands import EngineCommand, reference_command
from vime_rollout.engines.gate import behind_gates
from vime_rollout.engines.gated import TOKEN_ENV
from vime_rollout.engines.launchers import LocalLauncher, LocalProcess
from vime_rollout.engines.spec import EngineSpec

from tests.support.router_harness import FAKE_ENGINE
from vime import procs
from vime.clients.engine import EngineClient
from vime.config import load_config
from vime.models.tiny import ensure_tiny_qwen3

TOKEN = "gate-t0ken"


def _gated_engine(tmp: Path) -> tuple[EngineSpec, LocalLauncher, EngineCommand]:
    """One reference engine (nano model) planned behind a gate, its launcher and its command."""
    cfg = load_config(
        overrides=["rollout_num_gpus=0", "actor_num_gpus_per_node=0", "tensor_model_parallel_size=1"],
        environ={},
    )
    model = ensure_tiny_qwen3(os.environ.get("VIME_TEST_MODEL_CACHE") or tmp / "m", "micro")
    [spec] = behind_gates([EngineSpec(0, "reference", "127.0.0.1", procs.free_port())])
    return spec, LocalLauncher(tmp / "logs", token=TOKEN), reference_command(cfg, spec, str(model), "tiny")


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineSpec, LocalProcess]]:
    spec, launcher, command = _gated_engine(tmp_path_factory.mktemp("gate"))
    process = launcher.start(spec, command)
    assert isinstance(process, LocalProcess)
    try:
        procs.wait_healthy(spec.url, process.child, timeout_s=180)
        yield spec, process
    finally:
        process.stop()
    assert spec.socket and not any(Path(spec.socket).parent.iterdir())  # the token's file went with it


def test_a_stopped_engine_starts_again_in_its_directory(tmp_path: Path) -> None:
    """What the health monitor does after a crash: stop, then start the same spec."""
    spec, launcher, command = _gated_engine(tmp_path)
    for _ in range(2):
        process = launcher.start(spec, command)
        assert isinstance(process, LocalProcess)
        try:
            procs.wait_healthy(spec.url, process.child, timeout_s=180)
        finally:
            process.stop()


def test_the_engine_listens_only_on_a_private_socket(gated: tuple[EngineSpec, LocalProcess]) -> None:
    spec, process = gated
    assert spec.socket and stat.S_ISSOCK(os.stat(spec.socket).st_mode)
    assert stat.S_IMODE(os.stat(Path(spec.socket).parent).st_mode) == 0o700
    assert "--uds" in process.child.popen.args and "--port" not in process.child.popen.args
    config = Path(spec.socket).parent / f"{spec.name}-gate.json"
    assert stat.S_IMODE(os.stat(config).st_mode) == 0o600  # it holds the token
    with socket.create_connection((spec.host, spec.port), timeout=5):
        pass  # the port is the gate's


def test_reads_and_generate_are_open_control_needs_the_token(gated: tuple[EngineSpec, LocalProcess]) -> None:
    spec, _ = gated
    with httpx.Client(base_url=spec.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").status_code == 200
        body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2, "temperature": 0}}
        assert http.post("/inference/v1/generate", json=body).status_code == 200
        for path in ("/sleep", "/pause", "/update_weights", "/collective_rpc", "/reset_prefix_cache"):
            refused = http.post(path, json={})
            assert refused.status_code == 401, path
            assert "bearer token" in refused.json()["error"]["message"]
        assert http.post("/sleep", json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.get("/is_paused").json() == {"is_paused": False}  # nothing refused got through


async def test_the_stack_clients_pass_with_the_token(gated: tuple[EngineSpec, LocalProcess]) -> None:
    spec, _ = gated
    async with EngineClient(spec.url, token=TOKEN, timeout=60) as engine:
        await engine.pause("keep")
        try:
            async with httpx.AsyncClient(base_url=spec.url, timeout=10) as http:
                assert (await http.get("/is_paused")).json() == {"is_paused": True}
        finally:
            await engine.resume()


def test_a_dead_gate_is_a_dead_engine(gated: tuple[EngineSpec, LocalProcess]) -> None:
    _, process = gated
    assert process.alive()
    assert process.gate is not None
    process.gate.stop(grace_s=5)
    assert not process.alive()


def _gated_wrapper(directory: Path, port: int) -> procs.Child:
    """`engines.gated` as a container runs it (the launcher's arguments), around a fake engine."""
    socket_path = str(directory / "gate" / "engine0.sock")
    engine = [sys.executable, str(FAKE_ENGINE), "--uds", socket_path, "--engine-id", "e0"]
    where = ["--name", "engine0", "--host", "127.0.0.1", "--port", str(port), "--socket", socket_path]
    argv = [sys.executable, "-m", "vime_rollout.engines.gated", *where, "--", *engine]
    return procs.start("gated", argv, log_path=directory / "gated.log", env={TOKEN_ENV: TOKEN})


@pytest.mark.parametrize("ending", ["SIGTERM to the wrapper", "the engine dies"])
def test_the_container_wrapper_gates_its_engine_and_ends_with_it(ending: str) -> None:
    """engine.launcher=docker: gate and engine in one process tree (the container's first process)."""
    directory, port = Path(tempfile.mkdtemp(prefix="vime-gated-")), procs.free_port()  # short socket path
    wrapper = _gated_wrapper(directory, port)
    children = []
    try:
        url = f"http://127.0.0.1:{port}"
        procs.wait_healthy(url, wrapper, timeout_s=60)
        children = psutil.Process(wrapper.pid).children(recursive=True)
        assert stat.S_IMODE(os.stat(directory / "gate").st_mode) == 0o700
        with httpx.Client(base_url=url, timeout=10) as http:
            assert http.post("/sleep", json={}).status_code == 401
            assert (
                http.post("/sleep", json={}, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
            )
        engine = next(p for p in children if "fake_engine" in " ".join(p.cmdline()))
        assert TOKEN_ENV not in engine.environ()
        if ending == "SIGTERM to the wrapper":
            wrapper.popen.send_signal(signal.SIGTERM)
        else:
            engine.kill()
        wrapper.popen.wait(timeout=30)
        assert not procs.port_open("127.0.0.1", port)  # the gate went with it
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)
        assert not any((directory / "gate").iterdir())  # socket and the token's configuration removed
    finally:
        for p in children:  # in their own process groups: a failed test must not leave them behind
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        wrapper.kill()
        shutil.rmtree(directory)
