"""The engines the router was told about, and which of them get new requests.

Pure state, no I/O. The router does not judge engine health: whoever registers an engine vouches
for it and takes it out (the rollout manager registers the engines it holds healthy and with the
current weights, and deregisters them when they die). A drained engine gets no new requests; its
in-flight requests finish on their connections. `routable_urls()` is the set vllm-router's worker
list is kept equal to.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vime.service import ServiceError
from vime.wire.router import EngineRegistration, RegisteredEngine


@dataclass
class Engine:
    id: str
    url: str
    gpu_ids: list[int]
    registered_at: float = field(default_factory=time.time)
    draining: bool = False

    def status(self, in_data_plane: bool, in_flight: int | None = None) -> RegisteredEngine:
        return RegisteredEngine(
            id=self.id,
            url=self.url,
            gpu_ids=list(self.gpu_ids),
            draining=self.draining,
            routable=not self.draining and in_data_plane,
            in_flight=in_flight,
            registered_at=self.registered_at,
        )


class Registry:
    """Engines by id."""

    def __init__(self) -> None:
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

    def routable_urls(self) -> set[str]:
        return {e.url for e in self.engines.values() if not e.draining}
