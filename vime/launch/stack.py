"""What ``vime up`` starts, derived from the run config alone: the run directory, a private Redis
when none is configured, and one `ServiceSpec` per service (argv, health URL, dependencies, ports).

Ports are the config's (``services.*_port``, ``engine.base_port + k``); the defaults are fixed,
well-known ports so that ``vime status`` and ``vime rollout`` find a running stack without
arguments. Several stacks on one host need their own ports (the tests pick free ones); a port
already taken is refused before anything starts. A service whose ``services.<name>_url`` is set
runs elsewhere: it is waited for, not started. Redis is private (a free port, data under the run
directory) unless ``services.redis_url`` is set.

The resolved config (run id and Redis URL filled in, the API token left out) is written to
``runs/<run_id>/config.yaml``; every child reads that file, and it is also what to pass to
``vime status -c`` / ``vime rollout -c`` for this stack. The token reaches the children in their
environment; one generated for the stack (`vime.launch.token`) is kept beside the config.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vime import procs
from vime.config import RunConfig
from vime.launch.token import stack_token, write_token

LATEST = "latest"
"""``<output_dir>/latest`` links to the newest run directory (for ``vime status`` / ``vime rollout``)."""


@dataclass(frozen=True)
class ServiceSpec:
    """One service of the stack."""

    name: str
    argv: list[str]
    url: str
    """Base URL; ``url + /health`` answers 200 once the service is ready."""
    after: tuple[str, ...] = ()
    """Services that must be healthy before this one starts."""
    ports: tuple[int, ...] = ()
    """Ports it (or its children) listen on: checked free before start, freed after stop."""
    timeout_s: float = 120.0
    """How long it may take to become healthy."""
    external: bool = False
    """Runs elsewhere (its URL is configured): waited for, never started or stopped."""


@dataclass(frozen=True)
class StackPlan:
    """Everything `vime up` needs to start one stack."""

    cfg: RunConfig
    run_id: str
    run_dir: Path
    config_path: Path
    log_dir: Path
    redis_port: int | None
    """Port of the private redis-server to start (None: ``services.redis_url`` is used)."""
    services: list[ServiceSpec]
    token_generated: bool = False
    """The API token was generated for this stack (printed once, kept in ``<run_dir>/api_token``)."""

    @property
    def redis_dir(self) -> Path:
        return self.run_dir / "redis"

    def service(self, name: str) -> ServiceSpec:
        return next(s for s in self.services if s.name == name)

    def ports(self) -> dict[int, str]:
        """Every port this stack will listen on, with its owner."""
        owned = {p: s.name for s in self.services if not s.external for p in s.ports}
        if self.redis_port is not None:
            owned[self.redis_port] = "redis"
        return owned


def new_run_id(output_dir: Path) -> str:
    """A timestamp id (``YYYYmmdd-HHMMSS``), suffixed when that directory already exists."""
    base = time.strftime("%Y%m%d-%H%M%S")
    run_id, n = base, 1
    while (output_dir / run_id).exists():
        n += 1
        run_id = f"{base}-{n}"
    return run_id


def plan_stack(cfg: RunConfig) -> StackPlan:
    """Resolve run id, run directory, Redis, the API token and the service list (nothing is written
    or started)."""
    output_dir = Path(cfg.output_dir)
    run_id = cfg.run_id or new_run_id(output_dir)
    run_dir = output_dir / run_id
    redis_port = None
    services_cfg = cfg.services
    if services_cfg.redis_url is None:
        redis_port = procs.free_port(services_cfg.host)
        services_cfg = services_cfg.model_copy(
            update={"redis_url": f"redis://{services_cfg.host}:{redis_port}/0"}
        )
    token, generated = stack_token(cfg)
    services_cfg = services_cfg.model_copy(update={"api_token": token})
    resolved = cfg.model_copy(update={"run_id": run_id, "services": services_cfg})
    config_path = run_dir / "config.yaml"
    log_dir = run_dir / "logs"
    specs = service_specs(resolved, config_path, log_dir)
    return StackPlan(resolved, run_id, run_dir, config_path, log_dir, redis_port, specs, generated)


def service_specs(cfg: RunConfig, config_path: Path, log_dir: Path) -> list[ServiceSpec]:
    """router, reward, rollout (with its engines), trainer — in dependency order."""
    s = cfg.services
    conf = ["--config", str(config_path)]
    engine_ports: tuple[int, ...] = ()
    if cfg.engine.launcher == "local":
        engine_ports = tuple(cfg.engine.base_port + k for k in range(cfg.num_engines))
    return [
        ServiceSpec(
            "router",
            procs.python_module("vime_router", *conf, "--log-dir", str(log_dir)),
            s.url("router_control"),
            ports=(s.router_port, s.router_control_port),
            timeout_s=cfg.router.startup_timeout_s + 60,
            external=s.router_control_url is not None,
        ),
        ServiceSpec(
            "reward",
            procs.python_module("vime_reward", *conf),
            s.url("reward"),
            ports=(s.reward_port,),
            external=s.reward_url is not None,
        ),
        ServiceSpec(
            "rollout",
            procs.python_module("vime_rollout", *conf, "--log-dir", str(log_dir)),
            s.url("rollout"),
            after=("router", "reward"),
            ports=(s.rollout_port, *engine_ports),
            # Building the tiny model and loading the engines come first.
            timeout_s=cfg.engine.startup_timeout_s + 300,
            external=s.rollout_url is not None,
        ),
        ServiceSpec(
            "trainer",
            procs.python_module("vime_trainer", *conf),
            s.url("trainer"),
            after=("rollout",),
            ports=(s.trainer_port,),
            timeout_s=900,
            external=s.trainer_url is not None,
        ),
    ]


def config_document(cfg: RunConfig) -> dict[str, Any]:
    """The config as a YAML-able mapping that loads back to the same config (no derived values, no token)."""
    exclude: dict[str, Any] = dict.fromkeys(type(cfg).model_computed_fields, True)
    exclude["services"] = {"api_token"}
    return cfg.model_dump(mode="json", exclude=exclude)


def write_config(plan: StackPlan) -> Path:
    """Write the resolved config the children read (and a generated token beside it), point
    ``<output_dir>/latest`` at this run."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    plan.config_path.write_text(yaml.safe_dump(config_document(plan.cfg), sort_keys=False))
    if plan.token_generated and plan.cfg.services.api_token:
        write_token(plan.run_dir, plan.cfg.services.api_token)
    latest = plan.run_dir.parent / LATEST
    tmp = latest.with_name(f".{LATEST}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(plan.run_id, target_is_directory=True)
    os.replace(tmp, latest)
    return plan.config_path


def latest_config(output_dir: str | Path) -> Path | None:
    """The resolved config of the newest stack started under ``output_dir``, if any."""
    path = Path(output_dir) / LATEST / "config.yaml"
    return path if path.is_file() else None


def busy_ports(plan: StackPlan) -> list[str]:
    """Ports of this plan something already listens on, as readable complaints."""
    host = plan.cfg.services.host
    probe = procs.connect_host(host)
    return [
        f"port {port} ({owner}) is already in use"
        for port, owner in sorted(plan.ports().items())
        if procs.port_open(probe, port)
    ]
