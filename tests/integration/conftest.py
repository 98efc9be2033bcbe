"""Fixtures shared by the Megatron integration tests: a local Ray cluster and a tiny Qwen3 checkpoint
(module-scoped, so each test module gets its own and only modules that ask pay for them), and a
`Publisher` of rank batches to the session's Redis, which the ranks read them from.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.megatron import Publisher, local_ray
from vime.models.tiny import ensure_tiny_qwen3


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    with local_ray(num_cpus=2):
        yield


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_qwen3(tmp_path_factory.mktemp("models"), "nano")


@pytest.fixture
def publish(redis_url: str) -> Publisher:
    return Publisher(redis_url)
