"""The engine control surface: pause modes, wake tags, the shm weight payload, engine capabilities.

vime drives two kinds of engine through the same HTTP routes: real vLLM (0.26 on the GPU
machine; 0.33 read from its code) and the CPU reference engine. They differ in a few documented
ways that callers must branch on, and `EngineVersion` (from ``GET /version``) says which applies:

- weight version: 0.26 reports none anywhere; 0.33 and the reference engine report
  ``weight_versions`` spans per choice (the reference engine only once a version was set);
- requests arriving during ``/pause``: 0.26 and the reference engine hold them until resume in
  every mode; 0.33 answers 503 in ``abort``/``wait`` mode;
- ``/sleep`` and ``/wake_up`` bodies: empty in 0.26 and the reference engine, JSON in 0.33.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")

WAKE_TAGS = ("weights", "kv_cache")
"""The tags vLLM can leave asleep (its DEFERRABLE_TAGS); every other allocation wakes with any wake."""

SHM_BACKEND = "shm"
REFERENCE_ENGINE = "vime-reference"
GENERATE_ID_PREFIX = "generate-tokens-"


def normalize_wake_tags(tags: Iterable[str] | None) -> list[str] | None:
    """Keep only the tags vLLM knows (seed step 11: ``[kv_cache, cuda_graph]`` → ``[kv_cache]``).

    None means "wake everything"; a list left empty after filtering is returned empty, and the
    caller decides whether that is a no-op (vLLM would otherwise wake everything).
    """
    if tags is None:
        return None
    return [t for t in dict.fromkeys(tags) if t in WAKE_TAGS]


def shm_update_info(path: str | Path) -> dict[str, str]:
    """``update_info`` of one weight bucket sent as a safetensors file (the reference engine's transport)."""
    return {"backend": SHM_BACKEND, "path": str(path)}


def logprobs_mode_in(server_info: Any) -> str | None:
    """The ``--logprobs-mode`` in the body of vLLM's dev-mode ``GET /server_info?config_format=json``
    (the reference engine answers the same shape); None when the body does not hold it."""
    try:
        return str(server_info["vllm_config"]["model_config"]["logprobs_mode"])
    except (KeyError, TypeError):
        return None


def engine_request_id(request_id: str) -> str:
    """The id vLLM tracks (and ``/abort_requests`` takes) for a generate request sent with ``request_id``."""
    return request_id if request_id.startswith(GENERATE_ID_PREFIX) else GENERATE_ID_PREFIX + request_id


def _minor_version(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


class EngineVersion(BaseModel):
    """What ``GET /version`` says about an engine, and the behaviours that follow from it."""

    model_config = ConfigDict(extra="allow")

    version: str
    """vLLM version (for the reference engine: the vLLM API version it emulates)."""
    engine: str = "vllm"
    """``vllm``, or ``vime-reference`` for the CPU stand-in."""

    @property
    def is_reference(self) -> bool:
        return self.engine == REFERENCE_ENGINE

    @property
    def vllm_minor(self) -> tuple[int, int]:
        return _minor_version(self.version)

    @property
    def reports_weight_version(self) -> bool:
        """Whether generate responses can carry ``weight_versions`` (0.33+, reference engine)."""
        return self.is_reference or self.vllm_minor >= (0, 33)

    @property
    def rejects_requests_while_paused(self) -> bool:
        """0.33+ answers 503 to new requests during an abort/wait pause; 0.26 and the reference hold them."""
        return not self.is_reference and self.vllm_minor >= (0, 33)

    @classmethod
    def from_body(cls, body: Any) -> EngineVersion:
        if not isinstance(body, dict) or not isinstance(body.get("version"), str):
            raise ValueError(f"not a /version body: {body!r}")
        return cls.model_validate(body)
