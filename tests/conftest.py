"""Shared fixtures: a real redis-server per test session, and service processes on free ports."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vime import procs


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real redis-server started for this test session on a free port."""
    port = procs.free_port()
    child = procs.start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        child.stop()


@pytest.fixture
def api_token(monkeypatch: pytest.MonkeyPatch) -> str:
    """A bearer token exported as VIME_API_TOKEN for services started by the test."""
    token = "test-token-" + os.urandom(4).hex()
    monkeypatch.setenv("VIME_API_TOKEN", token)
    return token


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    """Where child-process logs of this test go."""
    d = tmp_path / "logs"
    d.mkdir()
    return d
