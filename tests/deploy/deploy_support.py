"""Helpers shared by the deployment checks: paths, finding and running the external tools.

The tools (helm, hadolint, docker-compose, kubernetes-validate) come from
scripts/setup_deploy_tools.sh. A missing tool is a test failure, never a skip: CI must install it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "k8s" / "vime"
COMPOSE = ROOT / "deploy" / "compose.yaml"
SETUP_HINT = "run `VIME_VENV=<venv> scripts/setup_deploy_tools.sh` (scripts/setup.sh calls it)"

Render = Callable[..., list[dict[str, Any]]]
ComposeConfig = Callable[..., dict[str, Any]]


def find_tool(name: str) -> str:
    """Path of a tool: the running venv's bin/ first (where the setup script puts it), then PATH."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: {SETUP_HINT}", pytrace=False)
    return found


def run_tool(
    argv: list[str], env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a tool and, when ``check``, fail the test with its output if it exits non-zero."""
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}", pytrace=False
        )
    return proc


def clean_env() -> dict[str, str]:
    """This process's environment without COMPOSE_* / VIME_* / HELM_* settings that would leak in."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "VIME_", "HELM_"))}
