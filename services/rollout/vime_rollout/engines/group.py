"""The engine group: start engines, register them with the router, fan memory calls out to all.

Seed steps 2 (start + register), 4–7 and 10–13 (onload ``weights`` / ``kv_cache``), 33–36
(offload at level 2 when engines receive weight updates, mode ``keep``), 28 (abort every
engine's requests). Every fan-out runs on all engines concurrently and reports each engine's
outcome; the health monitor (`health.py`) restarts engines that die. The router holds exactly the
engines this group says serve (`sync_router`): it judges no engine's health itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from vime.retry import poll_until
from vime.wire.engine import normalize_wake_tags
from vime.wire.rollout import LIVE, EngineState
from vime.wire.vllm import COMPACT_GENERATE_PATH, GENERATE_PATH
from vime_rollout.engines.commands import LOGPROBS_MODE, EngineCommand
from vime_rollout.engines.control import HEALTH_TIMEOUT_S, EngineControl, healthy
from vime_rollout.engines.launchers import Launcher
from vime_rollout.engines.records import EngineRecord, UpdateLock
from vime_rollout.engines.spec import EngineSpec

log = logging.getLogger("vime.rollout.engines")

ALL_TAGS = ("weights", "kv_cache")
ABORT_TIMEOUT_S = 10.0
"""A hung engine must not hold up the end of a rollout; the loop keeps re-sending aborts anyway."""


class RouterRegistry(Protocol):
    """The router's control plane as the engine group uses it."""

    async def register(self, url: str, *, gpu_ids: Sequence[int] = ()) -> object: ...

    async def deregister(self, engine: str) -> bool: ...

    async def registered_urls(self) -> set[str]: ...


class EngineStartError(RuntimeError):
    """An engine that did not become healthy."""


class EngineGroup:
    """All engines of the run and what the rollout manager knows about each."""

    def __init__(
        self,
        specs: list[EngineSpec],
        launcher: Launcher,
        command_for: Callable[[EngineSpec], EngineCommand | None],
        control_for: Callable[[str], EngineControl],
        router: RouterRegistry | None,
        *,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.records = [EngineRecord(spec, control_for(spec.url)) for spec in specs]
        self.launcher = launcher
        self.command_for = command_for
        self.router = router
        self.startup_timeout_s = startup_timeout_s
        self.current_version = 0
        """Version of the weights the trainer last reported loaded (0: the checkpoint)."""
        self.lock = UpdateLock()

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Launch every engine, wait until all answer /health, register them with the router."""
        await asyncio.gather(*(self.launch(rec) for rec in self.records))
        for rec in self.records:
            rec.status, rec.weight_version = EngineState.READY, 0
            await self.register(rec, strict=True)

    async def launch(self, rec: EngineRecord) -> None:
        """Start (or restart) one engine's process and wait until it is healthy."""
        cmd = self.command_for(rec.spec) if rec.spec.backend != "external" else None
        rec.process = await asyncio.to_thread(self.launcher.start, rec.spec, cmd)
        await self.wait_healthy(rec)
        await self.check_logprobs_mode(rec)
        rec.compact_generate = await rec.control.serves_compact_generate()
        rec.asleep.clear()
        rec.failures = 0

    @property
    def generate_path(self) -> str:
        """Where generate requests go: vime's compact route when every engine serves it (the engines
        vime starts), else vLLM's own (an external ``vllm serve``)."""
        if self.records and all(rec.compact_generate for rec in self.records):
            return COMPACT_GENERATE_PATH
        return GENERATE_PATH

    async def wait_healthy(self, rec: EngineRecord) -> None:
        async def up() -> bool:
            if rec.process is not None and rec.process.alive() is False:
                raise EngineStartError(
                    f"{rec.spec.name} exited before it was healthy:\n{rec.process.log_tail()}"
                )
            return await healthy(rec.control)

        try:
            await poll_until(
                up, timeout_s=self.startup_timeout_s, interval_s=0.25, what=f"{rec.spec.name} healthy"
            )
        except TimeoutError:
            raise EngineStartError(
                f"{rec.spec.name} at {rec.url} not healthy after {self.startup_timeout_s:.0f}s"
            ) from None

    async def check_logprobs_mode(self, rec: EngineRecord) -> None:
        """Refuse an engine whose log-probs are not those of the distribution it samples from.

        The trainer compares rollout log-probs with its own, computed after temperature (seed
        steps 24, 38); vLLM's default ``raw_logprobs`` ignores temperature, top-k and top-p, so an
        engine attached by URL and started without the flag would skew every ratio silently.
        """
        mode = await rec.control.logprobs_mode()
        if mode is None:
            log.warning("%s does not say its --logprobs-mode (no dev-mode /server_info)", rec.url)
        elif mode != LOGPROBS_MODE:
            raise EngineStartError(
                f"{rec.spec.name} at {rec.url} runs --logprobs-mode {mode}; vime needs "
                f"{LOGPROBS_MODE} (the log-probs of the tempered distribution it samples "
                f"from): restart it with --logprobs-mode {LOGPROBS_MODE}"
            )

    async def stop(self) -> None:
        """Deregister and stop every engine this group started."""
        for rec in self.records:
            await self.deregister(rec)
        await asyncio.gather(*(self._stop_process(rec) for rec in self.records))
        for rec in self.records:
            rec.status = EngineState.STOPPED
            await rec.control.aclose()

    async def _stop_process(self, rec: EngineRecord) -> None:
        if rec.process is not None:
            await asyncio.to_thread(rec.process.stop)

    # --- router --------------------------------------------------------------------------------
    async def register(self, rec: EngineRecord, *, strict: bool = False) -> None:
        """Put a serving engine in the router; a failure is logged (``strict``: raised) and the
        next `sync_router` tries again."""
        try:
            if self.router is not None and not rec.registered:
                await self.router.register(rec.url, gpu_ids=rec.spec.gpu_ids)
            rec.registered = True
        except Exception as exc:
            if strict:
                raise
            log.warning("registering %s with the router: %s (retried)", rec.url, exc)

    async def deregister(self, rec: EngineRecord) -> None:
        if self.router is not None and rec.registered:
            try:
                await self.router.deregister(rec.url)
            except Exception as exc:  # the router may be gone too; the engine is out either way
                log.warning("deregistering %s: %s", rec.url, exc)
        rec.registered = False

    async def sync_router(self) -> None:
        """Make the router hold exactly the serving engines of this group: re-register those it lost
        (a restarted router starts empty), take out those that no longer serve. Engines others
        registered there are left alone."""
        if self.router is None:
            return
        try:
            held = await self.router.registered_urls()
        except Exception as exc:  # the router is down or restarting: the next round tries again
            log.warning("listing the router's engines: %s", exc)
            return
        for rec in self.records:
            rec.registered = rec.url in held
            if rec.status is EngineState.READY and not rec.registered:
                log.info("%s is serving but not in the router: registering it", rec.spec.name)
                await self.register(rec)
            elif rec.status is not EngineState.READY and rec.registered:
                await self.deregister(rec)

    async def finished_requests(self) -> dict[str, float]:
        """Each live engine's finished-request counter (engines that do not say, or not within
        `HEALTH_TIMEOUT_S`, are left out)."""

        async def one(rec: EngineRecord) -> float | None:
            try:  # bounded like a health probe: a stuck /metrics must not hold the rollout up
                return await asyncio.wait_for(rec.control.finished_requests(), HEALTH_TIMEOUT_S)
            except Exception:  # a metric is not worth failing a rollout over
                return None

        records = self.live()
        counts = await asyncio.gather(*(one(r) for r in records))
        return {r.url: c for r, c in zip(records, counts, strict=True) if c is not None}

    # --- fan-out -------------------------------------------------------------------------------
    def live(self) -> list[EngineRecord]:
        return [r for r in self.records if r.status in LIVE]

    def serving(self) -> list[EngineRecord]:
        return [r for r in self.records if r.status is EngineState.READY]

    def coming_back(self) -> list[EngineRecord]:
        """Engines that do not serve now but will: restarting (or dead, when the monitor restarts
        them), or back and waiting for the trainer's weights."""
        back = (EngineState.STARTING, EngineState.RESTARTING, EngineState.NEEDS_WEIGHTS)
        return [
            r
            for r in self.records
            if r.status in back or (r.status is EngineState.DEAD and self.launcher.can_restart)
        ]

    async def _fan_out(
        self, records: list[EngineRecord], call: Callable[[EngineRecord], Any]
    ) -> dict[str, str]:
        async def one(rec: EngineRecord) -> str:
            try:
                await call(rec)
            except Exception as exc:
                rec.last_error = f"{type(exc).__name__}: {exc}"
                return f"error: {rec.last_error}"
            return "ok"

        results = await asyncio.gather(*(one(r) for r in records))
        return {r.url: res for r, res in zip(records, results, strict=True)}

    async def offload(self, level: int) -> dict[str, str]:
        """``POST /sleep?level=L&mode=keep`` on every live engine (seed steps 34–35)."""

        async def call(rec: EngineRecord) -> None:
            await rec.control.sleep(level, "keep")
            rec.asleep = set(ALL_TAGS)

        return await self._fan_out(self.live(), call)

    async def onload(self, tags: list[str] | None) -> tuple[list[str] | None, dict[str, str]]:
        """``POST /wake_up?tags=...`` on every live engine with the tags normalised (steps 5–6, 11–12)."""
        sent = normalize_wake_tags(tags)
        if sent == []:
            return sent, {r.url: "skipped: no vLLM tag" for r in self.live()}

        async def call(rec: EngineRecord) -> None:
            await rec.control.wake_up(sent)
            rec.asleep -= set(sent or ALL_TAGS)

        return sent, await self._fan_out(self.live(), call)

    async def abort_all(self) -> None:
        """Abort every request on every serving engine (seed step 28)."""
        await self._fan_out(
            self.serving(), lambda rec: asyncio.wait_for(rec.control.abort_requests(None), ABORT_TIMEOUT_S)
        )

    @property
    def asleep(self) -> bool:
        """Whether any live engine has memory asleep (rollouts would hang in its queue)."""
        return any(r.asleep for r in self.live())

    # --- weights -------------------------------------------------------------------------------
    def updatable(self) -> list[EngineRecord]:
        """Engines a weight push must reach: all live ones, those needing weights included."""
        return self.live()

    async def weights_loaded(self, version: int, urls: list[str] | None) -> list[EngineRecord]:
        """The trainer pushed ``version`` to ``urls`` (None: every live engine); those waiting serve
        again. A serving engine the push left out (it was gone when the push came) holds older
        weights: it leaves the router until a push brings it this version."""
        known = {r.url: r for r in self.records}
        unknown = sorted(set(urls or ()) - known.keys())
        if unknown:
            raise KeyError(f"unknown engine URL(s): {', '.join(unknown)}")
        targets = [known[u] for u in urls] if urls is not None else self.live()
        self.current_version = version
        for rec in targets:
            rec.weight_version = version
            if rec.status is EngineState.NEEDS_WEIGHTS:
                rec.status = EngineState.READY
                await self.register(rec)
        for rec in self.serving():
            if (rec.weight_version or 0) < version:
                log.warning(
                    "%s missed the push of v%d: out of the router until it holds it", rec.spec.name, version
                )
                rec.status = EngineState.NEEDS_WEIGHTS
                await self.deregister(rec)
        return targets
