"""Weight pushers: how the contract suite gets new weights into the engine under test.

A pusher does one whole weight-update round on one engine — ``/start_weight_update``, one or
more ``/update_weights``, ``/finish_weight_update`` (with the version label when given) — for a
set of Hugging Face–named tensors (any subset of the model's parameters). The suite only ever
calls `WeightPusher.push`, so the transport is pluggable:

- ``shm`` (built in, the default for the reference engine): each bucket is a safetensors file,
  sent as ``{"backend": "shm", "path": ...}`` — exactly what the trainer's shm transport sends.
- anything else: set ``VIME_CONTRACT_PUSHER=package.module:factory``. ``factory(work_dir: Path)``
  must return an object with ``async push(engine, tensors, *, version)``. For real vLLM the
  CUDA IPC pusher lives under ``tests/gpu/`` and is selected this way.

Against real vLLM without ``VIME_CONTRACT_PUSHER``, the tests that need a push are skipped and
say so.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

import torch

from vime.clients.base import ServiceCallError
from vime.clients.engine import EngineClient
from vime.wire.engine import shm_update_info


class WeightPusher(Protocol):
    async def push(
        self, engine: EngineClient, tensors: Mapping[str, torch.Tensor], *, version: str | None = None
    ) -> None: ...


def buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most ``bucket_bytes`` (a bigger tensor gets a bucket of its own)."""
    current: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > bucket_bytes:
            yield current
            current, size = {}, 0
        current[name] = t
        size += nbytes
    if current:
        yield current


class ShmPusher:
    """Buckets written as safetensors files in ``directory`` and named in ``update_info``."""

    def __init__(self, directory: Path, bucket_bytes: int = 1 << 20) -> None:
        self.directory = directory
        self.bucket_bytes = bucket_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self.pushes = 0

    async def push(
        self, engine: EngineClient, tensors: Mapping[str, torch.Tensor], *, version: str | None = None
    ) -> None:
        from safetensors.torch import save_file

        self.pushes += 1
        await engine.start_weight_update()
        try:
            for i, bucket in enumerate(buckets(tensors, self.bucket_bytes)):
                path = self.directory / f"push{self.pushes}-bucket{i}.safetensors"
                save_file({n: t.detach().contiguous().cpu() for n, t in bucket.items()}, str(path))
                try:
                    await engine.update_weights(shm_update_info(path))
                finally:
                    path.unlink(missing_ok=True)
        except BaseException:
            with contextlib.suppress(ServiceCallError):  # the engine may have ended the session already
                await engine.finish_weight_update()
            raise
        await engine.finish_weight_update(version)


def make_pusher(spec: str | None, work_dir: Path, reference: bool) -> WeightPusher | None:
    """The pusher named by ``spec`` (``shm`` or ``module:factory``); the default is shm for the reference engine."""
    spec = spec or os.environ.get("VIME_CONTRACT_PUSHER") or ("shm" if reference else None)
    if spec is None:
        return None
    if spec == "shm":
        return ShmPusher(work_dir / "shm-buckets")
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"VIME_CONTRACT_PUSHER must be 'shm' or 'module:factory', got {spec!r}")
    factory = getattr(importlib.import_module(module_name), attr)
    pusher: WeightPusher = factory(work_dir)
    return pusher
