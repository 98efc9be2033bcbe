"""Starting, watching and stopping the stack's processes.

Start: refuse busy ports, write the resolved config, become a subreaper (`orphans`), start Redis,
then each service as soon as the ones it needs are healthy, all health checks polled together.
Watch (`Supervisor.check`): a child that exits is restarted when its state survives it
(`RESTARTED`: Redis, the router, the reward service), else it is a failure of the whole stack.
Stop: services in reverse start order, each SIGTERM to its process group then SIGKILL after a
grace period (at once on a second Ctrl-C), then every process still below the launcher, then
check the ports are free.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass, field

import httpx
from rich.console import Console

from vime import procs
from vime.launch.logs import LogFollower, colour_of
from vime.launch.orphans import become_subreaper, kill_descendants
from vime.launch.signals import SignalLatch
from vime.launch.stack import ServiceSpec, StackPlan, busy_ports, write_config
from vime.retry import poll_until_blocking

STOP_GRACE_S = {"trainer": 60.0, "rollout": 45.0}
"""Seconds a service gets to stop after SIGTERM (the trainer may finish a checkpoint, the
rollout manager stops its engines); others get DEFAULT_GRACE_S."""
DEFAULT_GRACE_S = 10.0
RESTARTED = ("redis", "router", "reward")
"""Children started again, on the same ports, when they exit, because nothing is lost with them:
Redis keeps its data in the append-only file under the run directory; the router's engine list
is refilled by the rollout manager's health monitor (`EngineGroup.sync_router`), which the
in-flight generates wait for (``router.retry_window_s``); the reward service holds no state (a
lost idempotency entry only means a sample is scored again). The rollout manager (engines, data
position, running rollout) and the trainer (the run) are not restarted: their exit ends the stack,
and the run resumes from its last checkpoint (``vime train --resume``)."""
MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
"""A child that exits more than `MAX_RESTARTS` times within this many seconds is not restarted
again: the stack fails, as for a child that is never restarted."""


class StackError(RuntimeError):
    """The stack could not start or a child failed; the message says which and shows its log."""


class StackInterrupted(RuntimeError):
    """Ctrl-C or SIGTERM arrived while starting."""


@dataclass
class _Pending:
    spec: ServiceSpec
    child: procs.Child | None
    started: float
    deadline: float


@dataclass
class _Restart:
    """A restarted child, until it answers /health (Redis: until it listens, before it is kept)."""

    spec: ServiceSpec
    child: procs.Child
    started: float


@dataclass
class Supervisor:
    """The processes of one `StackPlan`."""

    plan: StackPlan
    console: Console
    latch: SignalLatch
    verbose: bool = False
    children: list[procs.Child] = field(default_factory=list)
    started: bool = False
    """Whether start() got as far as writing the run directory."""
    follower: LogFollower | None = None
    restarts: dict[str, list[float]] = field(default_factory=dict)
    """Each restarted child's restart times (`RESTART_WINDOW_S`)."""
    restarting: dict[str, _Restart] = field(default_factory=dict)

    # --- start -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start everything and return once every service answers /health."""
        busy = busy_ports(self.plan)
        if busy:
            raise StackError(
                "; ".join(busy) + ": another `vime up` may be running (stop it, or give this stack other "
                "ports with --set services.<name>_port=... / engine.base_port=...)"
            )
        write_config(self.plan)
        self.started = True
        become_subreaper()  # orphaned grandchildren come back to us (see orphans)
        self.follower = LogFollower([self.plan.log_dir, self.plan.redis_dir], self.console, self.verbose)
        self.follower.start()
        if self.plan.redis_port is not None:
            self.children.append(self._start_redis(self.plan.redis_port))
        self._start_services()

    def _start_redis(self, port: int) -> procs.Child:
        t0 = time.monotonic()
        try:
            child = procs.start_redis(port, self.plan.redis_dir, host=self.plan.cfg.services.host)
        except procs.StartupError as exc:
            raise StackError(str(exc)) from None
        self._ready("redis", f"{self.plan.cfg.services.redis_url}", time.monotonic() - t0)
        return child

    def _start_services(self) -> None:
        remaining = list(self.plan.services)
        healthy: set[str] = set()
        pending: dict[str, _Pending] = {}
        env = self._env()
        with httpx.Client(timeout=2.0) as http:
            while remaining or pending:
                if self.latch.fired:
                    raise StackInterrupted("interrupted while starting")
                for spec in [s for s in remaining if all(d in healthy for d in s.after)]:
                    remaining.remove(spec)
                    pending[spec.name] = self._launch(spec, env)
                dead = self.dead_child()
                if dead is not None:  # pending or already healthy: either way the stack is broken
                    raise StackError(self.death_message(dead, "while the stack was starting"))
                for name, p in list(pending.items()):
                    if self._check_pending(http, p):
                        healthy.add(name)
                        del pending[name]
                        self._ready(name, p.spec.url, time.monotonic() - p.started, p.spec.external)
                self.latch.wait(0.2)

    def _env(self) -> dict[str, str]:
        return {"VIME_API_TOKEN": token} if (token := self.plan.cfg.services.token()) else {}

    def _launch(self, spec: ServiceSpec, env: dict[str, str]) -> _Pending:
        now = time.monotonic()
        child = None
        if not spec.external:
            child = self._spawn(spec, env)
            self.children.append(child)
        return _Pending(spec, child, now, now + spec.timeout_s)

    def _spawn(self, spec: ServiceSpec, env: dict[str, str]) -> procs.Child:
        return procs.start(spec.name, spec.argv, log_path=self.plan.log_dir / f"{spec.name}.log", env=env)

    def _check_pending(self, http: httpx.Client, p: _Pending) -> bool:
        """True once healthy; raises when the child died or the deadline passed."""
        try:
            if http.get(p.spec.url + "/health").status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > p.deadline:
            tail = f"\n{p.child.log_tail()}" if p.child is not None else ""
            raise StackError(f"{p.spec.name} not healthy at {p.spec.url} after {p.spec.timeout_s:.0f}s{tail}")
        return False

    def _ready(self, name: str, url: str, seconds: float, external: bool = False) -> None:
        how = "found running" if external else f"ready in {seconds:.1f}s"
        self.console.print(f"[green]✓[/] [{colour_of(name)}]{name:<8}[/] {url}  [dim]{how}[/]")

    # --- watch -------------------------------------------------------------------------------
    def dead_child(self) -> procs.Child | None:
        """The first child that has exited, if any."""
        return next((c for c in self.children if not c.alive()), None)

    def check(self) -> procs.Child | None:
        """Restart the children of `RESTARTED` that exited (and say when they are back); return
        the first child whose exit fails the stack, if any."""
        self._check_restarting()
        for i, child in enumerate(self.children):
            if child.alive() or child.name in self.restarting:
                continue
            if not self._may_restart(child.name):
                return child
            self.children[i] = self._restart(child)
        return None

    def _may_restart(self, name: str) -> bool:
        if name not in RESTARTED:
            return False
        now = time.monotonic()
        recent = [t for t in self.restarts.get(name, []) if now - t < RESTART_WINDOW_S]
        self.restarts[name] = recent
        return len(recent) < MAX_RESTARTS

    def _restart(self, child: procs.Child) -> procs.Child:
        """The same service on the same ports; its process group is cleared first."""
        procs.signal_group(child.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            child.popen.wait(5)
        self.restarts.setdefault(child.name, []).append(time.monotonic())
        n = len(self.restarts[child.name])
        self.console.print(
            f"[yellow]↻ {child.name} exited with code {child.popen.returncode}; restarting it "
            f"({n}/{MAX_RESTARTS} in {RESTART_WINDOW_S / 60:.0f} min)[/]",
            highlight=False,
        )
        if child.name == "redis" and self.plan.redis_port is not None:
            return self._start_redis(self.plan.redis_port)  # listening within seconds: waited for here
        spec = self.plan.service(child.name)
        new = self._spawn(spec, self._env())
        self.restarting[child.name] = _Restart(spec, new, time.monotonic())
        return new

    def _check_restarting(self) -> None:
        for name, r in list(self.restarting.items()):
            if not r.child.alive():
                del self.restarting[name]  # its exit is handled like any other
                continue
            try:
                healthy = httpx.get(r.spec.url + "/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if healthy:
                del self.restarting[name]
                self.console.print(
                    f"[green]✓[/] [{colour_of(name)}]{name:<8}[/] back after "
                    f"{time.monotonic() - r.started:.1f}s",
                    highlight=False,
                )
            elif time.monotonic() - r.started > r.spec.timeout_s:
                del self.restarting[name]
                raise StackError(
                    f"{name} restarted but not healthy at {r.spec.url} after {r.spec.timeout_s:.0f}s\n"
                    f"{r.child.log_tail()}"
                )

    def death_message(self, child: procs.Child, when: str = "") -> str:
        where = f" ({child.log_path})" if child.log_path else ""
        code = child.popen.returncode
        by = f" ({signal.Signals(-code).name})" if code is not None and code < 0 else ""
        return (
            f"{child.name} exited with code {code}{by} {when}".rstrip()
            + f"; last lines of its log{where}:\n{child.log_tail(30)}"
        )

    # --- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every child in reverse start order, sweep leftovers, report ports still held."""
        for child in reversed(self.children):
            self._stop_child(child, STOP_GRACE_S.get(child.name, DEFAULT_GRACE_S))
        if self.started:
            leftovers = kill_descendants()
            if leftovers:
                listing = ", ".join(f"{pid} {cmd[:60]}" for pid, cmd in leftovers.items())
                self.console.print(f"[yellow]killed {len(leftovers)} leftover process(es): {listing}[/]")
        if self.follower is not None:
            self.follower.stop()
        self._report_held_ports()

    def _stop_child(self, child: procs.Child, grace_s: float) -> None:
        if child.alive():
            t0 = time.monotonic()
            procs.signal_group(child.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                poll_until_blocking(
                    lambda: not child.alive() or self.latch.hurry,
                    timeout_s=grace_s,
                    interval_s=0.05,
                    what="stop",
                )
            how = f"stopped in {time.monotonic() - t0:.1f}s"
            if child.alive():
                how = "killed"
            procs.signal_group(child.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                child.popen.wait(5)
            self.console.print(f"[dim]■ {child.name:<8} {how}[/]")
        else:
            procs.signal_group(child.pid, signal.SIGKILL)  # whatever it left in its group

    def _report_held_ports(self) -> None:
        with contextlib.suppress(TimeoutError):
            poll_until_blocking(
                lambda: not busy_ports(self.plan), timeout_s=3, interval_s=0.1, what="ports free"
            )
        for complaint in busy_ports(self.plan):
            self.console.print(f"[yellow]after stopping: {complaint}[/]")
