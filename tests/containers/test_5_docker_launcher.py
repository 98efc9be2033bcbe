"""The rollout manager's Docker launcher (`engine.launcher=docker`) on a real Docker engine.

A CPU reference engine runs in a sibling container started exactly as the rollout manager starts
one (its gate's plan, command builder, `container_spec`, the Docker SDK), from the image the compose
stack's CPU rollout service runs: it answers at its planned URL (host network) through its gate
inside the container (control routes only with the token), serves the mounted model, and a restart
after its container is killed takes the same name again. No GPU: the spec asks for none.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from vime_rollout.engines.commands import engine_command
from vime_rollout.engines.gate import CONTAINER_DIR, behind_gates
from vime_rollout.engines.launchers import DockerLauncher
from vime_rollout.engines.spec import plan_engines

from vime import procs
from vime.config import load_config
from vime.models.tiny import build_tiny_qwen3
from vime.retry import poll_until_blocking

START_S = 180
"""The container's start, the engine's imports and model load, on a shared 2-core machine."""
TOKEN = "launcher-t0ken"
IMAGE = f"{os.environ.get('VIME_IMAGE_PREFIX', 'vime')}-cpu-all:{os.environ.get('VIME_TAG', '0.1.0')}"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the image's user (uid 10001) can read: pytest's own tmp is private to root."""
    path = Path(tempfile.mkdtemp(prefix="vime-docker-launcher-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def _serving(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_docker_launcher_runs_and_restarts_a_reference_engine_container(shared_dir: Path) -> None:
    model = Path(build_tiny_qwen3(shared_dir / "model", "micro"))
    for p in [model, *model.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    logs = shared_dir / "logs"
    logs.mkdir()
    logs.chmod(0o777)  # the image's user writes there (mkdir's mode is cut by the umask)
    cfg = load_config(
        overrides=[
            "engine.launcher=docker",
            "engine.backend=reference",
            f"engine.base_port={procs.free_port_run()}",
        ]
    )
    [spec] = behind_gates(plan_engines(cfg, gpus=[])[:1], CONTAINER_DIR)  # as the factory plans it
    command = engine_command(cfg, spec, str(model), "micro")
    launcher = DockerLauncher("launcher-test", str(model), logs, IMAGE, token=TOKEN)

    proc = launcher.start(spec, command)
    try:
        assert proc.container.name == "vime-launcher-test-engine0"
        poll_until_blocking(
            lambda: _serving(spec.url) or proc.alive() is False,
            timeout_s=START_S,
            interval_s=1.0,
            what="the engine container serving",
        )
        assert proc.alive(), proc.log_tail()
        models = httpx.get(f"{spec.url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["micro"]
        # the port is the gate's (inside the container): control routes need the stack's token
        assert proc.container.attrs["Config"]["Cmd"][:3] == ["python3", "-m", "vime_rollout.engines.gated"]
        assert httpx.post(f"{spec.url}/pause", timeout=10).status_code == 401
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.post(f"{spec.url}/pause", headers=bearer, timeout=10).status_code == 200
        assert httpx.get(f"{spec.url}/is_paused", timeout=10).json() == {"is_paused": True}
        assert httpx.post(f"{spec.url}/resume", headers=bearer, timeout=10).status_code == 200
        assert proc.container.attrs["HostConfig"]["DeviceRequests"] in (None, [])

        proc.container.kill()  # the engine dies: the group's monitor sees it and restarts it
        poll_until_blocking(
            lambda: proc.alive() is False, timeout_s=30, interval_s=0.5, what="the killed container seen dead"
        )
        proc = launcher.start(spec, command)  # the dead container's name is taken back
        poll_until_blocking(
            lambda: _serving(spec.url) or proc.alive() is False,
            timeout_s=START_S,
            interval_s=1.0,
            what="the engine container serving",
        )
        assert proc.alive() and _serving(spec.url), proc.log_tail()
    finally:
        proc.stop()
    assert proc.alive() is False
    assert not launcher.client.containers.list(all=True, filters={"label": "vime.run=launcher-test"})
