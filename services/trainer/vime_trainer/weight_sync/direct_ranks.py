"""The trainer ranks as the direct load's driver (`direct_sync.DirectSync`) sees them: the
calls it makes on every rank (`RayRanks`, over the Ray actors; `direct_rank` runs inside each) and
the bucket the ranks agree they packed (`DirectBucket`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vime_trainer.weight_sync.direct_plan import DirectPlan
from vime_trainer.weight_sync.direct_rank import BufferKind
from vime_trainer.weight_sync.ipc import RankActors, call_on_ranks
from vime_trainer.weight_sync.ipc_payload import RankGpu
from vime_trainer.weight_sync.protocol import WeightSyncError


@dataclass(frozen=True)
class RankBuffers:
    """Where one trainer rank lives and its staging buffers' specs (none on CPU ranks other than 0)."""

    gpu: RankGpu
    buffers: list[dict[str, Any]]


class DirectRanks(Protocol):
    """What the direct load needs of the trainer ranks (`RayRanks`; tests run one in-process)."""

    def export_spec(self) -> Mapping[str, tuple[Sequence[int], str]]: ...
    def open(self, plan: DirectPlan, buffer_bytes: int, slots: int) -> list[RankBuffers]: ...
    def begin(self) -> None: ...
    def next(self, slot: int) -> list[dict[str, Any] | None]: ...
    def end(self) -> None: ...
    def close(self) -> None: ...


class RayRanks:
    """`DirectRanks` over the trainer's Ray actors (`direct_rank` runs inside each)."""

    def __init__(self, group: RankActors, kind: BufferKind, directory: str | None = None) -> None:
        self.group, self.kind, self.directory = group, kind, directory

    def export_spec(self) -> Mapping[str, tuple[Sequence[int], str]]:
        from vime_trainer.weight_sync import direct_rank

        spec: dict[str, Any] = call_on_ranks(self.group, direct_rank.direct_spec)[0]
        return {n: (shape, dtype) for n, (shape, dtype) in spec.items()}

    def open(self, plan: DirectPlan, buffer_bytes: int, slots: int) -> list[RankBuffers]:
        from vime_trainer.weight_sync import direct_rank

        raw = call_on_ranks(
            self.group,
            direct_rank.direct_open,
            plan.to_dict(),
            buffer_bytes,
            slots,
            self.kind,
            self.directory,
        )
        return [RankBuffers(RankGpu(r["rank"], r["gpu_uuid"], r["physical_gpu"]), r["buffers"]) for r in raw]

    def begin(self) -> None:
        from vime_trainer.weight_sync import direct_rank

        call_on_ranks(self.group, direct_rank.direct_begin)

    def next(self, slot: int) -> list[dict[str, Any] | None]:
        from vime_trainer.weight_sync import direct_rank

        return call_on_ranks(self.group, direct_rank.direct_next, slot)

    def end(self) -> None:
        from vime_trainer.weight_sync import direct_rank

        call_on_ranks(self.group, direct_rank.direct_end)

    def close(self) -> None:
        from vime_trainer.weight_sync import direct_rank

        if self.group.actors:
            call_on_ranks(self.group, direct_rank.direct_close)


@dataclass(frozen=True)
class DirectBucket:
    index: int
    params: list[list[Any]]
    nbytes: int
    checksum: str
    source_s: float = 0.0
    """The slowest rank's seconds making the bucket's HF tensors."""
    pack_s: float = 0.0
    """The slowest rank's seconds packing and checksumming them."""

    @classmethod
    def from_exports(cls, exports: Sequence[dict[str, Any] | None]) -> DirectBucket | None:
        """The bucket every rank packed (None after the last); the ranks must agree on it."""
        if all(e is None for e in exports):
            return None
        if any(e is None for e in exports):
            raise WeightSyncError("trainer ranks ran out of buckets at different points")
        done = [e for e in exports if e is not None]
        first = done[0]
        if any((e["index"], e["params"]) != (first["index"], first["params"]) for e in done):
            raise WeightSyncError(f"trainer ranks packed different buckets at bucket {first['index']}")
        sums = {e["checksum"] for e in done if e["checksum"] is not None}
        if len(sums) != 1:
            raise WeightSyncError(f"bucket {first['index']}: trainer ranks' checksums {sorted(sums)}")
        return cls(
            int(first["index"]),
            first["params"],
            int(first["nbytes"]),
            sums.pop(),
            max(float(e.get("source_s", 0.0)) for e in done),
            max(float(e.get("pack_s", 0.0)) for e in done),
        )
