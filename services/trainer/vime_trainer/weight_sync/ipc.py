"""The ``ipc`` transport (colocated GPUs): CUDA IPC handles of every rank's GPU, merged per engine.

The driver runs `ipc_rank`'s functions on all training ranks at once (``__ray_call__``), so the
ranks gather each bucket collectively and share it from their own GPU; `IpcBucket` then merges,
for each engine, the handles of the ranks on that engine's GPUs into vLLM's payload. GPU only:
on CPU ``ipc_open`` fails with a message pointing at ``trainer.weight_transport=shm``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import ray

from vime.wire.rollout import EngineInfo
from vime_trainer.weight_sync import ipc_rank
from vime_trainer.weight_sync.ipc_payload import IpcBucket, RankExport, RankGpu


class RankActors(Protocol):
    """What the transport needs of the trainer backend: its rank actors (`ActorGroup` has them)."""

    actors: list[Any]
    timeout_s: float | None


def call_on_ranks(group: RankActors, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``fn(rank, *args)`` inside every rank's actor at once; each rank's result, in rank order."""
    if not group.actors:
        raise RuntimeError("the trainer ranks are not started")
    refs = [actor.__ray_call__.remote(fn, *args) for actor in group.actors]
    return list(ray.get(refs, timeout=group.timeout_s))


class IpcTransport:
    """Buckets shared through CUDA IPC, one ``/update_weights`` per bucket per engine."""

    name = "ipc"

    def __init__(self, group: RankActors, packed: bool = True) -> None:
        self.group = group
        self.packed = packed
        self.init_info: dict[str, Any] | None = {}
        """vLLM 0.26's IPC engine takes no init fields (a no-op, sent as its own helper does)."""

    def buckets(self, engines: Sequence[EngineInfo]) -> IpcStream:
        return IpcStream(self.group, self.packed)


class IpcStream:
    """Each bucket exported by every rank at once; `close` (not running out) releases the ranks' last ones."""

    def __init__(self, group: RankActors, packed: bool) -> None:
        self.group, self.packed = group, packed
        self.ranks: list[RankGpu] | None = None

    def __iter__(self) -> IpcStream:
        return self

    def __next__(self) -> IpcBucket:
        if self.ranks is None:
            self.ranks = [RankGpu(**r) for r in call_on_ranks(self.group, ipc_rank.ipc_open, self.packed)]
        raw = call_on_ranks(self.group, ipc_rank.ipc_next)
        if all(r is None for r in raw):
            raise StopIteration
        if any(r is None for r in raw):
            raise RuntimeError("trainer ranks ran out of buckets at different points")
        return IpcBucket([RankExport.from_dict(r) for r in raw], self.ranks)

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks = None
            call_on_ranks(self.group, ipc_rank.ipc_close)
