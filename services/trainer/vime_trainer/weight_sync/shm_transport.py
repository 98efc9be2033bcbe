"""The ``shm`` transport: each bucket a safetensors file in ``/dev/shm`` (or a shared directory).

For CPU hosts (the reference engine loads ``{"backend": "shm", "path": ...}``) and for engines
that do not share the trainer's GPUs but share a filesystem. Global rank 0 of the trainer writes
the files (`ActorGroup.export_weight_buckets`, at most two ahead of the engines); a file is
deleted once every engine has loaded it and the bucket after it was asked for, or when the push
is abandoned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vime.wire.engine import shm_update_info
from vime.wire.rollout import EngineInfo


class BucketWriter(Protocol):
    """What the shm transport needs of the trainer backend (`ActorGroup` has it)."""

    def export_weight_buckets(self, directory: str | None = None) -> Iterator[dict[str, Any]]: ...


@dataclass(frozen=True)
class ShmBucket:
    path: str
    index: int
    nbytes: int
    num_tensors: int

    def update_info(self, engine: EngineInfo) -> dict[str, Any]:
        return shm_update_info(self.path)


class ShmTransport:
    """Buckets as files; every engine gets the same ``update_info``."""

    name = "shm"
    init_info: dict[str, Any] | None = None

    def __init__(self, writer: BucketWriter, directory: str | None = None) -> None:
        self.writer = writer
        self.directory = directory

    def buckets(self, engines: Sequence[EngineInfo]) -> ShmStream:
        return ShmStream(self.writer.export_weight_buckets(self.directory))


class ShmStream:
    """The files in order; a file is deleted two buckets later, the last ones by `close`."""

    def __init__(self, exported: Iterator[dict[str, Any]]) -> None:
        self.exported = exported
        self.alive: list[str] = []

    def __iter__(self) -> ShmStream:
        return self

    def __next__(self) -> ShmBucket:
        item = next(self.exported)
        bucket = ShmBucket(str(item["path"]), int(item["index"]), int(item["nbytes"]), len(item["names"]))
        self.alive.append(bucket.path)
        while len(self.alive) > 2:  # every engine loaded it: the one after it is being loaded now
            _unlink(self.alive.pop(0))
        return bucket

    def close(self) -> None:
        """Delete what is left: loaded by every engine, or the push was abandoned."""
        for path in self.alive:
            _unlink(path)
        self.alive = []
        close = getattr(self.exported, "close", None)
        if close is not None:
            close()  # drains and deletes what the writer already wrote ahead


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
