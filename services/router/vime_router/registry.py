"""The engines the router knows, and the health and drain rules that decide which of them serve.

Pure state, no I/O: the prober feeds it probe results, the API feeds it registrations and drains,
and `routable_urls()` is the set vllm-router's worker list is kept equal to.

Rules: a new engine serves after its first good probe; ``health_failure_threshold`` failed probes
in a row eject it; ``health_success_threshold`` good probes in a row re-admit it. A drained engine
gets no new requests whatever its health; its in-flight requests finish on their connections.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from vime.service import ServiceError
from vime.wire.router import EngineRegistration, EngineStatus

Transition = Literal["admitted", "ejected"] | None


@dataclass
class Engine:
    id: str
    url: str
    gpu_ids: list[int]
    registered_at: float = field(default_factory=time.time)
    healthy: bool = False
    draining: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    ejections: int = 0
    in_flight: int | None = None
    last_error: str | None = None
    last_probe_at: float | None = None

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    def status(self, in_data_plane: bool) -> EngineStatus:
        return EngineStatus(
            id=self.id,
            url=self.url,
            gpu_ids=list(self.gpu_ids),
            healthy=self.healthy,
            draining=self.draining,
            routable=self.routable and in_data_plane,
            in_flight=self.in_flight,
            consecutive_failures=self.consecutive_failures,
            ejections=self.ejections,
            last_error=self.last_error,
            last_probe_at=self.last_probe_at,
            registered_at=self.registered_at,
        )


class Registry:
    """Engines by id, with the ejection / re-admission thresholds."""

    def __init__(self, failure_threshold: int, success_threshold: int) -> None:
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.engines: dict[str, Engine] = {}

    def register(self, reg: EngineRegistration) -> tuple[Engine, bool]:
        """Add an engine; returns (engine, created). Re-registering the same id and URL is a no-op."""
        engine_id = reg.engine_id()
        current = self.engines.get(engine_id)
        if current is not None:
            if current.url != reg.url:
                raise ServiceError(409, f"engine {engine_id!r} is already registered with url {current.url}")
            current.gpu_ids = list(reg.gpu_ids) or current.gpu_ids
            return current, False
        for other in self.engines.values():
            if other.url == reg.url:
                raise ServiceError(409, f"url {reg.url} is already registered as engine {other.id!r}")
        engine = Engine(id=engine_id, url=reg.url, gpu_ids=list(reg.gpu_ids))
        self.engines[engine_id] = engine
        return engine, True

    def get(self, engine_id: str) -> Engine:
        engine = self.engines.get(engine_id)
        if engine is None:
            raise ServiceError(404, f"no engine {engine_id!r} is registered")
        return engine

    def remove(self, engine_id: str) -> Engine:
        engine = self.get(engine_id)
        del self.engines[engine_id]
        return engine

    def record_probe(
        self, engine: Engine, ok: bool, error: str | None, in_flight: int | None, now: float | None = None
    ) -> Transition:
        """Apply one probe result; returns what changed for routing."""
        engine.last_probe_at = time.time() if now is None else now
        if in_flight is not None or not ok:
            engine.in_flight = in_flight
        if ok:
            engine.consecutive_failures = 0
            engine.consecutive_successes += 1
            engine.last_error = None
            first = engine.ejections == 0
            if not engine.healthy and (first or engine.consecutive_successes >= self.success_threshold):
                engine.healthy = True
                return "admitted"
            return None
        engine.consecutive_successes = 0
        engine.consecutive_failures += 1
        engine.last_error = error
        if engine.healthy and engine.consecutive_failures >= self.failure_threshold:
            engine.healthy = False
            engine.ejections += 1
            return "ejected"
        return None

    def routable_urls(self) -> set[str]:
        return {e.url for e in self.engines.values() if e.routable}
