"""The system under `docker compose --profile cpu`, tested through what its user has: the published
ports, `docker compose` and `docker compose exec`.

These tests need a Docker engine with the images built from this checkout, so they run only when
asked (VIME_CONTAINERS=1): `scripts/containers.sh` builds the images in a private engine, brings
the stack up, runs them and removes everything (CI runs it after the plain suite, where they skip).
The modules run in file order: the surface first, then one training run on the fresh stack, then
the faults (a killed container, `down` + `up`, a Redis restart), which restart what they break.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from compose_stack import CPU_CONFIG, ROOT, Stack, compose_binary


def _why_not() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.environ.get("VIME_CONTAINERS") != "1":
        return (
            "container tests run through scripts/containers.sh (it builds the images from this "
            "checkout); VIME_CONTAINERS=1 runs them against an engine that has the images already"
        )
    compose_bin = compose_binary()
    if compose_bin is None:
        return None  # the fixture fails: a missing tool is not a reason to skip
    probe = subprocess.run([compose_bin, "ls"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        where = os.environ.get("DOCKER_HOST", "the default socket")
        return f"no Docker engine reachable at {where}: {probe.stderr.strip()[-300:]}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    mine = [item for item in items if here in item.path.parents]
    if mine and (reason := _why_not()) is not None:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """The stack, up and healthy (`up --wait`); it is left up for whoever brought it up."""
    compose_bin = compose_binary()
    if compose_bin is None:
        pytest.fail("docker-compose is not installed: run scripts/setup.sh", pytrace=False)
    token_file = Path(os.environ.get("VIME_TOKEN_FILE") or ROOT / "deploy" / "secrets" / "api_token")
    if not token_file.is_file():
        pytest.fail(f"no token file {token_file} (set VIME_TOKEN_FILE)", pytrace=False)
    st = Stack(compose_bin, os.environ.get("VIME_BIND", "127.0.0.1"), token_file.read_text().strip())
    st.up()
    yield st


@pytest.fixture(scope="session")
def cpu_config() -> dict:
    """The run config the cpu pair runs with (deploy/config/cpu.yaml)."""
    return dict(yaml.safe_load(CPU_CONFIG.read_text()))


@pytest.fixture
def awake(stack: Stack) -> None:
    """The engines awake: the stack starts them asleep (colocated: they sleep until a run wakes
    them), and a sleeping engine holds generate requests, as vLLM does."""
    status, body = stack.call("http://rollout:18083/v1/engines/onload", "POST", {})
    assert status == 200, body
