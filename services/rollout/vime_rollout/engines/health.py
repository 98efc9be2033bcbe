"""The health monitor: the one judge of engine health. It finds dead engines, restarts them, and
keeps the router holding exactly the engines that serve.

Paused while engines are offloaded (seed step 33: a sleeping engine is not a dead one) and while
the trainer holds the weight-update lock; paused, it still looks for engine processes that exited
and marks them dead — out of the router and of the memory calls and pushes, which would fail on
them — leaving their restart (GPU memory the trainer may be using) for when it resumes. An engine
is dead when its process exited (seen at the next check) or when ``failure_threshold`` probes in a
row failed; it is taken out of the router at once. A restarted engine comes back with the checkpoint's weights: if the trainer has pushed any
since (version > 0) it waits as ``needs_weights``, out of the router, until the trainer pushes and
reports them loaded; otherwise it serves at once. An engine attached by URL (external) cannot be
restarted: it is taken out while it fails and put back when it answers again. Each round ends by
syncing the router with the serving set (`EngineGroup.sync_router`), so a restarted router gets
the engines back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from vime.wire.rollout import LIVE, EngineState
from vime_rollout.engines.control import HEALTH_TIMEOUT_S, healthy
from vime_rollout.engines.group import EngineGroup
from vime_rollout.engines.records import EngineRecord

log = logging.getLogger("vime.rollout.health")

MAX_RESTART_BACKOFF_S = 60.0


class HealthMonitor:
    """Probes every engine each ``interval_s`` and restarts the dead ones (one task per restart)."""

    def __init__(
        self,
        group: EngineGroup,
        *,
        interval_s: float = 2.0,
        failure_threshold: int = 2,
        timeout_s: float = HEALTH_TIMEOUT_S,
    ) -> None:
        self.group = group
        self.interval_s = interval_s
        self.failure_threshold = failure_threshold
        self.timeout_s = timeout_s
        self._paused_by: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._restarts: dict[str, asyncio.Task[None]] = {}

    # --- pause / resume --------------------------------------------------------------------------
    def pause(self, reason: str) -> None:
        self._paused_by.add(reason)

    def resume(self, reason: str) -> None:
        self._paused_by.discard(reason)

    @property
    def paused(self) -> bool:
        return bool(self._paused_by) or self.group.lock.held()

    # --- loop --------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="engine-health")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._restarts.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._task = None
        self._restarts.clear()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await (self.find_exited() if self.paused else self.check_once())
            except Exception:  # the monitor must outlive any one bad probe
                log.exception("health check failed")

    async def find_exited(self) -> None:
        """While paused: engines whose process exited are dead (no probe, no restart yet)."""
        for rec in self.group.records:
            if rec.status in LIVE and rec.process is not None and rec.process.alive() is False:
                await self._dead(rec, "process exited")

    async def check_once(self) -> None:
        """Probe each engine once (a restart task for each newly dead one), then sync the router."""
        await asyncio.gather(*(self._check(rec) for rec in self.group.records))
        await self.group.sync_router()

    async def _check(self, rec: EngineRecord) -> None:
        if rec.url in self._restarts or rec.status in (EngineState.STOPPED, EngineState.STARTING):
            return
        exited = rec.process is not None and rec.process.alive() is False
        ok = not exited and await healthy(rec.control, self.timeout_s)
        if ok:
            rec.failures = 0
            if rec.status is EngineState.DEAD:  # an external engine that came back
                await self._back(rec)
            return
        rec.failures += 1
        if rec.status is not EngineState.DEAD and (exited or rec.failures >= self.failure_threshold):
            await self._dead(rec, "process exited" if exited else f"{rec.failures} failed health probes")
        if rec.status is EngineState.DEAD and self.group.launcher.can_restart:
            self._restarts[rec.url] = asyncio.create_task(self._restart(rec), name=f"restart-{rec.spec.name}")

    async def _dead(self, rec: EngineRecord, why: str) -> None:
        rec.status, rec.last_error = EngineState.DEAD, why
        log.warning("%s at %s is dead (%s)", rec.spec.name, rec.url, why)
        await self.group.deregister(rec)

    async def _restart(self, rec: EngineRecord) -> None:
        try:
            delay = min(MAX_RESTART_BACKOFF_S, 2.0**rec.restarts - 1)
            await asyncio.sleep(delay)
            rec.status = EngineState.RESTARTING
            rec.restarts += 1
            if rec.process is not None:
                await asyncio.to_thread(rec.process.stop)
            await self.group.launch(rec)
            await self._back(rec)
        except Exception as exc:
            rec.status = EngineState.DEAD
            rec.last_error = f"restart failed: {exc}"
            log.error("%s: %s", rec.spec.name, rec.last_error)
        finally:
            self._restarts.pop(rec.url, None)

    async def _back(self, rec: EngineRecord) -> None:
        """A healthy engine after a death: serve now, or wait for the trainer's weights."""
        rec.failures = 0
        if self.group.current_version > 0:
            rec.status, rec.weight_version = EngineState.NEEDS_WEIGHTS, 0
            log.info("%s is back and needs weights v%d", rec.spec.name, self.group.current_version)
        else:
            rec.status, rec.weight_version = EngineState.READY, 0
            await self.group.register(rec)
            log.info("%s is back and serving", rec.spec.name)
