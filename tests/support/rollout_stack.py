"""The rollout side of a stack as real processes on loopback, started from one config file: the
reward service, the router (control plane + vllm-router) and the rollout manager, for the tests and
benches that drive these services themselves rather than through ``vime up``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vime import procs


def start_rollout_services(
    cfg_path: Path,
    services: Mapping[str, Any],
    logs: Path,
    children: list[procs.Child],
    *,
    reward_env: Mapping[str, str] | None = None,
    manager_env: Mapping[str, str] | None = None,
    manager_timeout_s: float = 300.0,
) -> str:
    """Reward service and router, healthy, then the rollout manager, healthy; returns its URL.

    ``services`` is the config's ``services`` section (the ports). Each process is appended to
    ``children`` as it starts, so the caller's clean-up stops it even when a later one fails.
    """
    conf = ("--config", str(cfg_path))
    reward = procs.start(
        "reward", procs.python_module("vime_reward", *conf), log_path=logs / "reward.log", env=reward_env
    )
    children.append(reward)
    router = procs.start(
        "router",
        procs.python_module("vime_router", *conf, "--log-dir", str(logs)),
        log_path=logs / "router.log",
    )
    children.append(router)
    procs.wait_healthy(f"http://127.0.0.1:{services['reward_port']}", reward, timeout_s=120)
    procs.wait_healthy(f"http://127.0.0.1:{services['router_control_port']}", router, timeout_s=120)
    manager = procs.start(
        "rollout",
        procs.python_module("vime_rollout", *conf, "--log-dir", str(logs)),
        log_path=logs / "rollout.log",
        env=manager_env,
    )
    children.append(manager)
    url = f"http://127.0.0.1:{services['rollout_port']}"
    procs.wait_healthy(url, manager, timeout_s=manager_timeout_s)
    return url
