"""``vime status``: health of each service, the engines, and the current run, from their REST APIs.

Read-only GETs, so it needs no token. Exit code 0 when every service is healthy, 1 otherwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from vime.config import RunConfig

SERVICES = ("router_control", "router", "reward", "rollout", "trainer")


@dataclass
class ServiceHealth:
    name: str
    url: str
    healthy: bool
    detail: str


@dataclass
class StackStatus:
    services: list[ServiceHealth]
    engines: list[dict[str, Any]] = field(default_factory=list)
    run: dict[str, Any] | None = None
    redis: str | None = None

    @property
    def healthy(self) -> bool:
        return all(s.healthy for s in self.services) and self.redis in (None, "ok")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "healthy": self.healthy}


def _get(http: httpx.Client, url: str) -> tuple[int | None, Any]:
    try:
        r = http.get(url)
    except httpx.HTTPError as exc:
        return None, type(exc).__name__
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text[:200]


def _health(http: httpx.Client, name: str, url: str) -> ServiceHealth:
    # The router's data plane (vllm-router behind the route filter) answers /health too.
    code, body = _get(http, url + "/health")
    if code == 200:
        return ServiceHealth(name, url, True, _brief(body))
    return ServiceHealth(name, url, False, f"HTTP {code}: {body}" if code else f"unreachable ({body})")


def _brief(body: Any) -> str:
    """The scalar fields of a /health answer (nested objects are for --json)."""
    if not isinstance(body, dict):
        return ""
    skip = ("status", "service", "uptime_s")
    return ", ".join(f"{k}={v}" for k, v in body.items() if k not in skip and not isinstance(v, dict | list))


def _redis(url: str | None) -> str | None:
    if url is None:
        return None
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        client.ping()
        client.close()
        return "ok"
    except redis.RedisError as exc:
        return f"unreachable ({type(exc).__name__})"


def gather(cfg: RunConfig) -> StackStatus:
    """Ask every service; never raises for a service that is down."""
    s = cfg.services
    with httpx.Client(timeout=5.0) as http:
        services = [_health(http, name, s.url(name)) for name in SERVICES]  # type: ignore[arg-type]
        status = StackStatus(services, redis=_redis(s.redis_url))
        code, body = _get(http, s.url("rollout") + "/v1/engines")
        if code == 200 and isinstance(body, dict):
            status.engines = list(body.get("engines", []))
        code, body = _get(http, s.url("trainer") + "/v1/runs")
        if code == 200 and isinstance(body, dict):
            active = body.get("active")
            runs = body.get("runs", [])
            current = next((r for r in runs if r.get("run_id") == active), runs[-1] if runs else None)
            status.run = current
    return status


def render(status: StackStatus, console: Console) -> None:
    """Tables for services and engines, one line for the run."""
    table = Table("service", "url", "health", "detail", title="services")
    for svc in status.services:
        mark = "[green]healthy[/]" if svc.healthy else "[red]down[/]"
        table.add_row(svc.name, svc.url, mark, svc.detail)
    if status.redis is not None:
        table.add_row(
            "redis", "", "[green]healthy[/]" if status.redis == "ok" else "[red]down[/]", status.redis
        )
    console.print(table)
    if status.engines:
        engines = Table(
            "engine", "url", "backend", "status", "weights", "asleep", "restarts", title="engines"
        )
        for e in status.engines:
            engines.add_row(
                str(e.get("index")),
                str(e.get("url")),
                str(e.get("backend")),
                str(e.get("status")),
                f"v{e.get('weight_version')}",
                ",".join(e.get("asleep") or []) or "-",
                str(e.get("restarts", 0)),
            )
        console.print(engines)
    run = status.run
    if run:
        console.print(
            f"run [bold]{run.get('run_id')}[/]: {run.get('state')} ({run.get('phase')}), "
            f"{run.get('steps_done', 0)}/{run.get('num_rollout')} rollouts, weights v{run.get('weight_version')}",
            highlight=False,
        )
    else:
        console.print("no run (start one with `vime train`)")
