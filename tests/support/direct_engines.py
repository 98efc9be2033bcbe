"""Reference engines for the direct load's CPU tests and the `DirectSync` pieces they share: an
engine process started with the worker extension (or without it), its `EngineInfo`, the checkpoint's
tensors as a trainer would push them, and a fallback that fails the test when it is used."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vime_trainer.weight_sync import WeightSync

from vime import procs
from vime.wire.rollout import EngineInfo


def start_engine(model: Path, logs: Path, name: str, *extra: str) -> tuple[procs.Child, str]:
    """A reference engine serving ``model`` with one thread, healthy; its process and URL."""
    port = procs.free_port()
    argv = procs.python_module(
        "vime_rollout.reference_engine", "--model", str(model), "--port", str(port), "--threads", "1", *extra
    )
    child = procs.start(name, argv, log_path=logs / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_healthy(url, child, timeout_s=180)
    except BaseException:
        child.stop()
        raise
    return child, url


def info(url: str, restarts: int = 0) -> EngineInfo:
    return EngineInfo(
        index=0, url=url, backend="reference", status="ready", registered=True, restarts=restarts
    )


def pushed_weights(model: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with ``lm_head`` negated: what the engine serves changes when they land."""
    from safetensors.torch import load_file

    weights = load_file(str(model / "model.safetensors"))
    return {k: -v if k == "lm_head.weight" else v for k, v in weights.items()}


class Unused(WeightSync):
    """A fallback for a `DirectSync` that must not fall back."""

    def __init__(self) -> None:
        super().__init__(None)  # type: ignore[arg-type]

    async def push(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the direct load fell back")
