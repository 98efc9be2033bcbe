"""The data plane's two processes, started, watched and restarted by the router service.

- vllm-router on a private loopback port: picks the engine (policy from the config), retries
  refused connections on another engine. Circuit breaker off (under overload every circuit opens
  at once and it answers 503 to everything), its own health checks effectively off (the rollout
  manager is the one judge of engine health and registers only the engines that serve), request
  timeout from the config, ``--log-level warning`` *and* ``RUST_LOG=warn``: 0.1.17 ignores the
  flag and logs two or three INFO lines per request (consistent_hash's CONSISTENT_HASH_DEBUG).
- the route filter (Caddy, configured by `vime_router.route_filter`) on the public port,
  forwarding only the generate routes to vllm-router.

Each runs under `vime_router.orphan_guard`, so it dies with the service even if the service is
SIGKILLed. A process that exits is restarted on the same port, with backoff if it keeps dying.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vime import procs
from vime.caddy import caddy_binary
from vime.config import RouterConfig
from vime.retry import poll_until
from vime_router.placeholders import Placeholders
from vime_router.route_filter import filter_counters, write_config

log = logging.getLogger("vime.router.data_plane")

ROUTER_HEALTH_INTERVAL_S = 86_400
"""vllm-router's own health checks: once a day, i.e. off; the registrants decide what serves."""
WORKER_ADD_TIMEOUT_S = 10
"""How long vllm-router's ``POST /workers`` waits for a new worker's ``/health``."""
LIVENESS_INTERVAL_S = 2.0
LIVENESS_TIMEOUT_S = 2.0
"""Each data-plane process must answer its ready URL this fast, every interval (3 misses: killed)."""


@dataclass
class DataPlaneSpec:
    """Where the data-plane processes listen and how vllm-router is tuned."""

    host: str
    port: int
    config: RouterConfig
    log_dir: Path
    router_port: int = field(default_factory=procs.free_port)
    prometheus_port: int = field(default_factory=procs.free_port)
    stats_port: int = field(default_factory=procs.free_port)
    placeholder_ports: tuple[int, int] = field(default_factory=lambda: (procs.free_port(), procs.free_port()))

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def public_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


def vllm_router_argv(spec: DataPlaneSpec) -> list[str]:
    cfg = spec.config
    return procs.python_module(
        "vllm_router.launch_router",
        "--host", "127.0.0.1",
        "--port", str(spec.router_port),
        "--policy", cfg.policy,
        "--log-level", "warning",
        "--disable-circuit-breaker",
        "--request-timeout-secs", str(max(1, round(cfg.request_timeout_s))),
        "--max-payload-size", str(cfg.max_body_bytes),
        "--health-check-interval-secs", str(ROUTER_HEALTH_INTERVAL_S),
        "--worker-startup-timeout-secs", str(WORKER_ADD_TIMEOUT_S),
        "--worker-startup-check-interval", "1",
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(spec.prometheus_port),
        *(["--worker-urls", *Placeholders(spec.placeholder_ports).urls] if cfg.policy == "power_of_two" else []),
    )  # fmt: skip


def filter_argv(spec: DataPlaneSpec) -> list[str]:
    """``caddy run`` with the filter's configuration written into the log directory."""
    state = spec.log_dir / "route-filter"
    state.mkdir(parents=True, exist_ok=True)
    config = write_config(
        state / "caddy.json",
        host=spec.host,
        port=spec.port,
        upstream_port=spec.router_port,
        stats_port=spec.stats_port,
        max_body_bytes=spec.config.max_body_bytes,
        state_dir=state,
    )
    return [caddy_binary(), "run", "--config", str(config)]


class Supervised:
    """One data-plane process: how to start it and how to tell it is ready."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        ready_url: str,
        log_path: Path,
        timeout_s: float,
        env: dict[str, str] | None = None,
        listens: tuple[str, int] | None = None,
    ) -> None:
        """``listens``: a second address it must accept connections on before it counts as started
        (Caddy opens its servers one by one, in no fixed order)."""
        self.listens = listens
        self.name = name
        self.argv = argv
        self.env = env or {}
        self.ready_url = ready_url
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.child: procs.Child | None = None
        self.restarts = 0
        self.failures = 0
        """Restarts in a row that did not last 30 s (backoff)."""
        self.misses = 0
        """Liveness checks in a row it did not answer."""
        self.started_at = 0.0

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    async def start(self) -> None:
        # Started from the event-loop thread: the parent-death signal follows the creating thread.
        argv = procs.python_module("vime_router.orphan_guard", *self.argv)
        self.child = procs.start(
            self.name, argv, log_path=self.log_path, env={**self.env, "VIME_PARENT_PID": str(os.getpid())}
        )
        self.started_at = time.monotonic()
        await asyncio.to_thread(procs.wait_healthy, self.ready_url, self.child, self.timeout_s, path="")
        if self.listens is not None:
            host, port = self.listens
            await poll_until(
                lambda: asyncio.to_thread(procs.port_open, host, port),
                timeout_s=self.timeout_s,
                interval_s=0.05,
                what=f"{self.name} listening on {host}:{port}",
            )

    async def stop(self) -> None:
        if self.child is not None:
            await asyncio.to_thread(self.child.stop, 15.0)

    async def answers(self, timeout_s: float) -> bool:
        """Whether it answers its ready URL now (a hung process is alive but silent)."""
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as http:
                return (await http.get(self.ready_url)).status_code == 200
        except httpx.HTTPError:
            return False


class DataPlane:
    """vllm-router + the route filter; `supervise()` restarts whichever exits."""

    def __init__(self, spec: DataPlaneSpec, on_router_start: Callable[[], Awaitable[None]]) -> None:
        self.spec = spec
        self.on_router_start = on_router_start
        timeout = spec.config.startup_timeout_s
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        self.router = Supervised(
            "vllm-router",
            vllm_router_argv(spec),
            f"{spec.router_url}/liveness",
            spec.log_dir / "vllm-router.log",
            timeout,
            env={"RUST_LOG": "warn", "NO_COLOR": "1"},
        )
        self.route_filter = Supervised(
            "route-filter",
            filter_argv(spec),
            f"http://127.0.0.1:{spec.stats_port}/metrics",
            spec.log_dir / "route-filter.log",
            timeout,
            env={
                "XDG_CONFIG_HOME": str(spec.log_dir / "route-filter"),
                "XDG_DATA_HOME": str(spec.log_dir / "route-filter"),
            },
            listens=(procs.connect_host(spec.host), spec.port),
        )
        self.placeholders = Placeholders(spec.placeholder_ports)
        self.ready = False

    @property
    def restarts(self) -> int:
        return self.router.restarts + self.route_filter.restarts

    async def start(self) -> None:
        if self.spec.config.policy == "power_of_two":
            await self.placeholders.start()
        await self.router.start()
        await self.on_router_start()
        await self.route_filter.start()
        self.ready = True

    async def supervise(self, interval_s: float = 0.25) -> None:
        """Restart a process that exited or hangs (forever; cancelled when the service stops).

        Liveness: every `LIVENESS_INTERVAL_S` each process must answer its ready URL within
        `LIVENESS_TIMEOUT_S`; three silences in a row and it is killed and restarted.
        """
        every = max(1, round(LIVENESS_INTERVAL_S / interval_s))
        timeout = LIVENESS_TIMEOUT_S
        tick = 0
        while True:
            await asyncio.sleep(interval_s)
            tick += 1
            for proc in (self.router, self.route_filter):
                if proc.alive() and tick % every == 0:
                    proc.misses = 0 if await proc.answers(timeout) else proc.misses + 1
                    if proc.misses >= 3 and proc.child is not None:
                        log.error("%s is alive but has not answered 3 checks; killing it", proc.name)
                        await asyncio.to_thread(proc.child.kill)
                if not proc.alive():
                    await self._restart(proc)
            self.ready = self.router.alive() and self.route_filter.alive()

    async def _restart(self, proc: Supervised) -> None:
        self.ready = False
        code = proc.child.popen.returncode if proc.child else None
        tail = proc.child.log_tail(10) if proc.child else ""
        log.error("%s exited (%s); restarting. Log tail:\n%s", proc.name, code, tail)
        if time.monotonic() - proc.started_at > 30:
            proc.failures = 0
        await asyncio.sleep(min(10.0, 0.5 * 2**proc.failures) if proc.failures else 0)
        proc.failures += 1
        proc.restarts += 1
        proc.misses = 0
        try:
            if proc.child is not None:
                await asyncio.to_thread(proc.child.stop, 1.0)
            await proc.start()
            if proc is self.router:
                await self.on_router_start()
        except Exception as exc:  # keep supervising; the next round tries again
            log.error("restarting %s failed: %s", proc.name, exc)

    async def stop(self) -> None:
        self.ready = False
        await self.route_filter.stop()
        await self.router.stop()
        self.placeholders.stop()

    async def filter_counts(self) -> dict[str, int]:
        """The route filter's counters ({} when it does not answer)."""
        try:
            async with httpx.AsyncClient(timeout=1.0) as http:
                r = await http.get(f"http://127.0.0.1:{self.spec.stats_port}/metrics")
            return filter_counters(r.content) if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}

    def pids(self) -> tuple[int | None, int | None]:
        router = self.router.child.pid if self.router.alive() and self.router.child else None
        filter_pid = (
            self.route_filter.child.pid if self.route_filter.alive() and self.route_filter.child else None
        )
        return router, filter_pid
