"""The router's wire: its public data-plane routes and its control-plane JSON shapes.

The data plane (seed steps 20–21) is the port the rollout manager posts generate requests to; it
serves only `PUBLIC_ROUTES`. The engines' control routes (sleep, pause, update_weights, ...) are
unauthenticated in vLLM and, for CUDA IPC over HTTP, unpickle what they are sent, so the router
must never forward them. The control plane registers, drains and reports engines.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vime.wire.bounds import MAX_COUNT
from vime.wire.vllm import COMPACT_GENERATE_PATH, GENERATE_PATH

PUBLIC_ROUTES: dict[str, frozenset[str]] = {
    GENERATE_PATH: frozenset({"POST"}),
    COMPACT_GENERATE_PATH: frozenset({"POST"}),
    "/v1/completions": frozenset({"POST"}),
    "/v1/chat/completions": frozenset({"POST"}),
    "/health": frozenset({"GET"}),
    "/v1/models": frozenset({"GET"}),
}
"""Path -> methods the data plane forwards; every other request is answered 404/405 by the router."""

SESSION_HEADER = "X-Session-ID"
"""Routing key of the consistent_hash policy (seed step 17: one uuid per sample)."""

ENGINE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"

RoutingPolicy = Literal["round_robin", "power_of_two", "consistent_hash"]


def normalize_engine_url(url: str) -> str:
    """``http://host:port`` with no trailing slash; raises ValueError for anything else."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"engine url {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"engine url {url!r} has no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"engine url {url!r} must be a bare http://host:port (no path, query or user)")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"engine url {url!r} has an invalid port") from exc
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def default_engine_id(url: str) -> str:
    """The id an engine registered by URL alone gets: its ``host:port``."""
    return urlsplit(normalize_engine_url(url)).netloc


class EngineRegistration(BaseModel):
    """Body of ``POST /v1/engines``: an engine the router may send generate requests to."""

    model_config = ConfigDict(extra="forbid")

    url: str
    """Base URL of the engine (``http://host:port``); it must answer ``GET /health`` when registered."""
    id: str | None = Field(None, pattern=ENGINE_ID_PATTERN)
    """Stable name of the engine; defaults to the URL's ``host:port``."""
    gpu_ids: list[int] = Field(default_factory=list, max_length=MAX_COUNT)
    """GPUs the engine runs on (informational; shown in listings)."""

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return normalize_engine_url(value)

    @field_validator("gpu_ids")
    @classmethod
    def _gpus(cls, value: list[int]) -> list[int]:
        if any(not 0 <= g < MAX_COUNT for g in value) or len(set(value)) != len(value):
            raise ValueError(f"gpu_ids must be distinct integers in [0, {MAX_COUNT})")
        return value

    def engine_id(self) -> str:
        """The id given, else the default derived from the URL."""
        return self.id or default_engine_id(self.url)


class RegisteredEngine(BaseModel):
    """One engine in the router's registry. The router does not judge health: the registrant (the
    rollout manager, for the engines it runs) takes an engine out when it stops serving."""

    id: str
    url: str
    gpu_ids: list[int]
    draining: bool
    """Drained by an operator: no new requests, in-flight ones finish."""
    routable: bool
    """Receiving new requests now (not draining, and in vllm-router's worker list)."""
    in_flight: int | None = None
    """Requests running + waiting on the engine (its ``vllm:num_requests_*`` metrics), read by
    ``GET /v1/engines/{id}``; None in listings and where the engine does not say."""
    registered_at: float


class DataPlaneStatus(BaseModel):
    """The processes behind the public port."""

    url: str
    """Where generate requests go (the public port of the route filter)."""
    router_url: str
    """vllm-router's private loopback address behind the filter (for diagnostics and benchmarks)."""
    policy: RoutingPolicy
    ready: bool
    router_pid: int | None
    filter_pid: int | None
    restarts: int
    """Restarts of either process since the service started."""
    workers: list[str]
    """Engine URLs registered in vllm-router at the last reconciliation."""
    forwarded: int = 0
    """Requests the route filter passed to vllm-router."""
    refused: int = 0
    """Requests the route filter answered itself (control routes, malformed HTTP)."""
    in_flight: int = 0
    """Requests forwarded and not answered yet."""


class EngineList(BaseModel):
    """Body of ``GET /v1/engines``."""

    engines: list[RegisteredEngine]
    data_plane: DataPlaneStatus
