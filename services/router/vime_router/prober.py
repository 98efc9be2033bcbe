"""The control plane's health checks: probe every engine, eject the silent, re-admit the recovered.

Every ``health_check_interval_s`` each engine gets ``GET /health`` (``health_check_timeout_s``);
the registry turns the results into ejections and re-admissions, and vllm-router's worker list is
then synced to the routable set. An engine that stops answering is out of the data plane within
about ``health_failure_threshold × interval + timeout`` seconds. The same round reads each engine's
``/metrics`` for its in-flight count (vLLM's ``vllm:num_requests_running`` + ``_waiting``), which
is how a drained engine is seen to finish its requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx

from vime.wire.engine_metrics import IN_FLIGHT, metric_sum
from vime_router.registry import Engine, Registry

log = logging.getLogger("vime.router.prober")


def parse_in_flight(metrics_text: bytes) -> int | None:
    """Sum of vLLM's running + waiting gauges over all label sets; None when absent."""
    total = metric_sum(metrics_text, IN_FLIGHT)
    return None if total is None else round(total)


class Prober:
    """Probes engines and applies the results; `run()` loops until cancelled."""

    def __init__(
        self,
        registry: Registry,
        *,
        interval_s: float,
        timeout_s: float,
        on_change: Callable[[], Awaitable[None]],
    ) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_change = on_change
        self._http = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_keepalive_connections=0))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def probe(self, engine: Engine) -> tuple[bool, str | None, int | None]:
        """(healthy, error, in_flight) of one engine."""
        try:
            r = await self._http.get(f"{engine.url}/health")
        except httpx.HTTPError as exc:
            return False, f"/health: {type(exc).__name__}: {exc}"[:300], None
        if r.status_code != 200:
            return False, f"/health answered {r.status_code}", None
        return True, None, await self.in_flight(engine)

    async def in_flight(self, engine: Engine) -> int | None:
        """The engine's running + waiting requests from its /metrics; None if it does not say."""
        try:
            m = await self._http.get(f"{engine.url}/metrics")
        except httpx.HTTPError:
            return None
        return parse_in_flight(m.content) if m.status_code == 200 else None

    async def check(self, engine: Engine) -> str | None:
        """Probe one engine and record the result; returns the transition, if any."""
        ok, error, in_flight = await self.probe(engine)
        if self.registry.engines.get(engine.id) is not engine:
            return None  # removed while the probe ran
        change = self.registry.record_probe(engine, ok, error, in_flight)
        if change == "ejected":
            log.warning("engine %s (%s) ejected: %s", engine.id, engine.url, error)
            # Out of the data plane now, not after the slowest probe of this round.
            await self.on_change()
        elif change == "admitted":
            log.info("engine %s (%s) admitted", engine.id, engine.url)
        return change

    async def round(self) -> None:
        """One probe of every engine, then a sync of the data plane."""
        engines = list(self.registry.engines.values())
        await asyncio.gather(*(self.check(e) for e in engines))
        await self.on_change()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.round()
            except Exception as exc:  # a sync failure must not stop the health checks
                log.error("health round failed: %s", exc)
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))
