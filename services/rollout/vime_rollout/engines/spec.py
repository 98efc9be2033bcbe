"""Which engines a run has: backend, GPU ids, port and URL of each (seed step 2).

``num_engines = rollout_num_gpus // rollout_num_gpus_per_engine`` (8 // 2 = 4 in the seed); engine
k gets GPUs ``[k·tp, (k+1)·tp)`` of the visible ones and listens on ``engine.base_port + k``.
``engine.backend=auto`` picks real vLLM when it is installed and GPUs are visible, else the CPU
reference engine; ``engine.launcher=external`` takes engines already running at ``engine.urls``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

from vime.config import RunConfig

Backend = Literal["vllm", "reference", "external"]


class EnginePlanError(ValueError):
    """A config whose engines cannot be placed (too few GPUs, no URLs for external engines)."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine: where it listens and which GPUs it owns."""

    index: int
    backend: Backend
    host: str
    port: int
    gpu_ids: tuple[int, ...] = ()
    external_url: str | None = None
    socket: str | None = None
    """The Unix socket the engine listens on when a gate (`engines.gate`) owns ``host:port``."""

    @property
    def url(self) -> str:
        return self.external_url or f"http://{self.host}:{self.port}"

    @property
    def name(self) -> str:
        return f"engine{self.index}"


def visible_gpus() -> list[int]:
    """GPU ids this process may hand out: CUDA_VISIBLE_DEVICES when set, else what nvidia-smi lists."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [int(x) for x in env.split(",") if x.strip().isdigit()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [i for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def resolve_backend(cfg: RunConfig, gpus: list[int]) -> Backend:
    """``engine.backend`` with ``auto`` resolved (vLLM needs both the package and a GPU)."""
    if cfg.engine.launcher == "external":
        return "external"
    if cfg.engine.backend != "auto":
        return cfg.engine.backend
    has_vllm = importlib.util.find_spec("vllm") is not None
    return "vllm" if has_vllm and gpus and cfg.rollout_num_gpus > 0 else "reference"


def plan_engines(cfg: RunConfig, gpus: list[int] | None = None) -> list[EngineSpec]:
    """The engines of this run, in index order."""
    gpus = visible_gpus() if gpus is None else gpus
    backend = resolve_backend(cfg, gpus)
    host, base = cfg.engine.host, cfg.engine.base_port
    if backend == "external":
        if not cfg.engine.urls:
            raise EnginePlanError("engine.launcher=external needs engine.urls (one base URL per engine)")
        return [
            EngineSpec(k, "external", host, base + k, external_url=u.rstrip("/"))
            for k, u in enumerate(cfg.engine.urls)
        ]
    if backend == "reference":
        return [EngineSpec(k, "reference", host, base + k) for k in range(cfg.num_engines)]
    tp = cfg.rollout_num_gpus_per_engine
    if len(gpus) < cfg.rollout_num_gpus:
        raise EnginePlanError(
            f"rollout_num_gpus={cfg.rollout_num_gpus} but only {len(gpus)} GPU(s) are visible: "
            f"lower rollout_num_gpus or expose more GPUs"
        )
    return [
        EngineSpec(k, "vllm", host, base + k, tuple(gpus[k * tp : (k + 1) * tp]))
        for k in range(cfg.num_engines)
    ]
