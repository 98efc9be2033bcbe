"""Fixtures for the deployment checks: the rendered chart and the compose model.

Nothing here touches the network; the Kubernetes schemas ship inside kubernetes-validate.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import CHART, COMPOSE, ComposeConfig, Render, clean_env, find_tool, run_tool

# --- helm ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def helm() -> str:
    return find_tool("helm")


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A private HOME / helm cache so helm writes nothing outside the test's temp dir."""
    home = tmp_path_factory.mktemp("helm-home")
    env = clean_env()
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / "cache"), XDG_CONFIG_HOME=str(home / "config"))
    env.update(XDG_DATA_HOME=str(home / "data"), KUBECONFIG=str(home / "kubeconfig"))
    return env


@pytest.fixture(scope="session")
def render(helm: str, helm_env: dict[str, str]) -> Render:
    """``render(*values_files, set=[...])`` -> the chart's manifests as dicts (helm template)."""

    def _render(*values: str, set: Iterable[str] = (), kube_version: str = "1.29.0") -> list[dict[str, Any]]:
        argv = [helm, "template", "vime", str(CHART), "--kube-version", kube_version]
        for v in values:
            argv += ["-f", str(CHART / v)]
        for s in set:
            argv += ["--set", s]
        out = run_tool(argv, env=helm_env).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    return _render


@pytest.fixture(scope="session")
def default_manifests(render: Render) -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="session")
def cpu_manifests(render: Render) -> list[dict[str, Any]]:
    return render("values-cpu.yaml")


# --- compose -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def compose_bin() -> str:
    return find_tool("docker-compose")


@pytest.fixture(scope="session")
def compose_config(compose_bin: str) -> ComposeConfig:
    """``compose_config(profile=None, file=COMPOSE)`` -> `docker compose config` as a dict.

    No profile means the file's own default (deploy/.env selects `gpu`), as a plain `up` sees it.
    """

    def _config(profile: str | None = None, file: Path = COMPOSE, env: dict[str, str] | None = None) -> dict:
        argv = [compose_bin, "-f", str(file)]
        if profile:
            argv += ["--profile", profile]
        argv += ["config", "--format", "json"]
        merged = clean_env() | (env or {})
        return json.loads(run_tool(argv, env=merged).stdout)

    return _config
