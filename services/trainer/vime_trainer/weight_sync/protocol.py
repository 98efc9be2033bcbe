"""vLLM's four-phase weight update, driven on every engine at once (seed steps 46–52).

46 pause: ``abort`` when this version flushes (in-flight requests die, new ones wait), else
   ``keep`` (frozen in place); then, when flushing, ``/reset_prefix_cache`` with running requests
   reset — retried once a second, up to 60 times, while blocks are still held. The async mode's
   in-flight update names ``keep`` and, when flushing, pauses with ``clear_cache=true`` instead:
   vLLM resets the caches itself once the engine is idle, the kept requests recompute their KV
   with the new weights on resume (a separate reset after the pause took 5.45 s of retries on
   vLLM 0.26, H100, 12-06);
47 ``/start_weight_update`` (after ``/init_weight_transfer_engine`` when the transport has an
   init body: IPC sends ``{}``, as vLLM's helper does; a no-op in 0.26);
48–50 one ``/update_weights`` per bucket, the same bucket to every engine concurrently; the
   transport prepares the next bucket while the engines load this one, and it is sent once all of
   them have;
51 ``/finish_weight_update {"weight_version": "<v>"}`` (0.33 and the reference engine keep the
   label; 0.26 ignores the body);
52 ``/resume``.

Every call of a push goes to all engines at once; each phase is timed apart (`PushReport.phases`,
and the ``seconds`` of its ``weights.<phase>`` event). ``engine.weight_load: direct`` replaces
47–51 by the engines' direct-load extension (`direct_sync`).

An engine that is gone when the push pauses it (no connection, or its gate's 502: nothing behind
it) is left out of the push, with a warning and a ``weights.engine_gone`` event; the others get
the version, and the rollout manager, told which engines loaded it, keeps the one left out of the
router until it holds it (its restart is caught up). A push that fails after the pause leaves the
engines paused: serving half-updated weights would be worse than not serving. The update session
is closed best-effort so a later push can start.
The caller must have woken the engines' ``weights`` first — vLLM has no guard.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vime.clients.base import ServiceCallError, ServiceUnreachable
from vime.clients.engine import EngineClient
from vime.wire.engine import PauseMode
from vime.wire.rollout import EngineInfo
from vime_trainer.weight_sync.transport import OutgoingBucket, WeightTransport

log = logging.getLogger("vime.trainer.weights")

T = TypeVar("T")
EventFn = Callable[..., object]
UPDATE_TIMEOUT_S = 300.0
"""vLLM's own helper waits 300 s for one ``/update_weights``."""


class WeightSyncError(RuntimeError):
    """A phase of the push failed on at least one engine; the message names them."""


@dataclass
class PushReport:
    version: int
    flushed: bool
    engines: list[str]
    buckets: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    """Pause → resume."""
    phases: dict[str, float] = field(default_factory=dict)
    weight_load: str = "vllm"
    """How the engines loaded the weights: ``vllm`` (its weight loaders) or ``direct``."""
    update_parts: dict[str, float] = field(default_factory=dict)
    """Where the direct load's update went, summed over its buckets (seconds): ``pack_wait_s``
    the driver waiting for a bucket's packing (the engines may be copying the one before),
    ``slot_wait_s`` waiting for the engines to finish with a slot before it is packed again,
    ``source_s`` / ``pack_s`` the slowest rank making and packing the HF tensors, ``load_s`` each
    load's call from its send to its last answer (two loads overlap: the second queues in the
    engines), ``engine_s`` the slowest engine's own copy and checksum inside them."""


def engine_gone(exc: BaseException) -> bool:
    """No engine behind the URL: no connection, or the gate in front of it answering 502."""
    return isinstance(exc, ServiceUnreachable) or (
        isinstance(exc, ServiceCallError) and exc.status_code == 502
    )


def no_event(action: str, **detail: Any) -> None:
    return None


def pause_mode(flush: bool) -> PauseMode:
    """Seed step 46: ``abort`` when the push flushes the cache, else ``keep``."""
    return "abort" if flush else "keep"


class WeightSync:
    """Pushes a transport's buckets to a set of engines with vLLM's update protocol."""

    def __init__(
        self,
        transport: WeightTransport,
        *,
        on_event: EventFn = no_event,
        reset_attempts: int = 60,
        reset_interval_s: float = 1.0,
        client_factory: Callable[[str], EngineClient] | None = None,
        token: str | None = None,
    ) -> None:
        """``token``: the stack's, sent on every engine call (it opens the engines' gates)."""
        self.transport = transport
        self.on_event = on_event
        self.reset_attempts = reset_attempts
        self.reset_interval_s = reset_interval_s
        self.client_factory = client_factory or (
            lambda url: EngineClient(url, token=token, timeout=UPDATE_TIMEOUT_S)
        )

    async def push(
        self, engines: Sequence[EngineInfo], version: int, flush: bool, mode: PauseMode | None = None
    ) -> PushReport:
        """Seed steps 46–52 on ``engines``, pausing with ``mode`` (None: `pause_mode`); returns what
        was sent."""
        report = PushReport(version, flush, [e.url for e in engines])
        if not engines:
            return report

        async def load(clients: dict[str, EngineClient], engines: Sequence[EngineInfo]) -> None:
            init_info = getattr(self.transport, "init_info", None)
            if init_info is not None:
                await self._phase(report, "init", clients, lambda c: c.init_weight_transfer_engine(init_info))
            await self._phase(report, "start", clients, lambda c: c.start_weight_update())
            try:
                await self._send_buckets(report, engines, clients)
                await self._phase(
                    report, "finish", clients, lambda c: c.finish_weight_update(version), version=version
                )
            except BaseException:
                await self._close_sessions(clients)
                raise

        return await self._framed(report, engines, mode or pause_mode(flush), load)

    async def _framed(
        self,
        report: PushReport,
        engines: Sequence[EngineInfo],
        mode: PauseMode,
        load: Callable[[dict[str, EngineClient], Sequence[EngineInfo]], Awaitable[None]],
    ) -> PushReport:
        """Seed step 46 (pause; the prefix-cache flush when the report is ``flushed``), ``load``, step 52 (resume), timed into
        ``report``; engines gone at the pause are left out; every engine client closed after, whatever failed."""
        clients = {e.url: self.client_factory(e.url) for e in engines}
        closing = list(clients.values())
        start = time.perf_counter()
        try:
            in_pause = mode == "keep" and report.flushed  # vLLM flushes once the engine is idle
            gone = await self._phase(
                report,
                "pause",
                clients,
                lambda c: c.pause(mode, clear_cache=in_pause),
                leave_out=engine_gone,
                mode=mode,
            )
            for url in gone:
                del clients[url]
                report.engines.remove(url)
                self.on_event("weights.engine_gone", url=url, version=report.version)
            if clients:
                if report.flushed and not in_pause:
                    await self._phase(report, "flush", clients, self._reset_prefix_cache)
                await load(clients, [e for e in engines if e.url in clients])
                await self._phase(report, "resume", clients, lambda c: c.resume())
        finally:
            await asyncio.gather(*(c.aclose() for c in closing), return_exceptions=True)
        report.seconds = time.perf_counter() - start
        return report

    async def _send_buckets(
        self, report: PushReport, engines: Sequence[EngineInfo], clients: dict[str, EngineClient]
    ) -> None:
        it = self.transport.buckets(engines)
        t0 = time.perf_counter()
        ahead: asyncio.Future[Any] = asyncio.ensure_future(asyncio.to_thread(_next_or_none, it))
        try:
            while (bucket := await ahead) is not None:
                tb = time.perf_counter()
                loading = asyncio.ensure_future(
                    _fan_out(
                        "update_weights", {e.url: _update_call(clients[e.url], bucket, e) for e in engines}
                    )
                )
                ahead = asyncio.ensure_future(asyncio.to_thread(_next_or_none, it))  # the next, meanwhile
                await loading
                report.buckets += 1
                report.nbytes += bucket.nbytes
                self.on_event(
                    "weights.update",
                    bucket=bucket.index,
                    nbytes=bucket.nbytes,
                    tensors=bucket.num_tensors,
                    seconds=round(time.perf_counter() - tb, 4),
                )
        finally:
            await asyncio.gather(ahead, return_exceptions=True)
            await asyncio.to_thread(it.close)  # frees (or deletes) what the transport still holds
            report.phases["update"] = time.perf_counter() - t0
        if report.buckets == 0:
            raise WeightSyncError(f"the {self.transport.name} transport produced no weight bucket")

    async def _phase(
        self,
        report: PushReport,
        name: str,
        clients: dict[str, EngineClient],
        call: Callable[[EngineClient], Awaitable[Any]],
        *,
        leave_out: Callable[[BaseException], bool] | None = None,
        **detail: Any,
    ) -> list[str]:
        """One call on every engine at once, timed; event ``weights.<name>`` (not for ``init``);
        returns the engines left out (`_fan_out`)."""
        t0 = time.perf_counter()
        gone = await _fan_out(name, {url: call(c) for url, c in clients.items()}, leave_out=leave_out)
        report.phases[name] = seconds = time.perf_counter() - t0
        if name != "init":
            self.on_event(f"weights.{name}", seconds=round(seconds, 4), **detail)
        return gone

    async def aclose(self) -> None:
        """Release what the sync holds across pushes (nothing for the stock push)."""

    async def _reset_prefix_cache(self, client: EngineClient) -> None:
        """Flush the prefix cache; vLLM answers success=false while blocks are held, so retry."""
        last: str = "never answered"
        for attempt in range(self.reset_attempts):
            try:
                if await client.reset_prefix_cache(reset_running_requests=True, reset_external=True):
                    return
                last = "success=false (blocks still held)"
            except (ServiceCallError, ServiceUnreachable) as exc:
                last = str(exc)
            if attempt + 1 < self.reset_attempts:
                await asyncio.sleep(self.reset_interval_s)
        raise WeightSyncError(f"reset_prefix_cache failed {self.reset_attempts} times: {last}")

    async def _close_sessions(self, clients: dict[str, EngineClient]) -> None:
        """After a failed update: end the engines' update sessions (they stay paused)."""
        results = await asyncio.gather(
            *(c.finish_weight_update() for c in clients.values()), return_exceptions=True
        )
        for url, res in zip(clients, results, strict=True):
            if isinstance(res, BaseException):
                log.warning("closing the update session of %s: %s", url, res)


def _update_call(client: EngineClient, bucket: OutgoingBucket, engine: EngineInfo) -> Awaitable[None]:
    return client.update_weights(bucket.update_info(engine), timeout=UPDATE_TIMEOUT_S)


async def _fan_out(
    phase: str, calls: dict[str, Awaitable[Any]], *, leave_out: Callable[[BaseException], bool] | None = None
) -> list[str]:
    """Await one call per engine concurrently; any failure is a WeightSyncError naming the engines,
    except, when every failure is one ``leave_out`` accepts, the engines that failed are returned
    (each with a warning)."""
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    failed = {url: r for url, r in zip(calls, results, strict=True) if isinstance(r, BaseException)}
    for r in failed.values():
        if isinstance(r, asyncio.CancelledError | KeyboardInterrupt):
            raise r
    if failed and leave_out is not None and all(leave_out(e) for e in failed.values()):
        for url, e in failed.items():
            log.warning(
                "%s: %s is gone (%s: %s); the push goes on without it", phase, url, type(e).__name__, e
            )
        return list(failed)
    if failed:
        detail = "; ".join(f"{url}: {type(e).__name__}: {e}" for url, e in failed.items())
        raise WeightSyncError(f"{phase} failed on {len(failed)} engine(s): {detail}")
    return []


def _next_or_none(it: Iterator[T]) -> T | None:
    return next(it, None)
