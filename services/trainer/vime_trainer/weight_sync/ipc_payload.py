"""vLLM's IPC ``update_info`` payload, built from what each trainer rank exported (seed steps 48–50).

Every trainer rank holds every full HF tensor of a bucket on its own GPU and shares it through a
CUDA IPC handle: ``{gpu_uuid: rebuild_cuda_tensor args}``. An engine's workers each look up
their own GPU's UUID, so the handles of the ranks on that engine's GPUs are merged into one dict
per tensor (unpacked) or per bucket (packed), pickled and base64-encoded for HTTP, exactly as
vLLM's own ``IPCWeightTransferEngine`` helper sends them (0.26 and 0.33)::

    {"names": [...], "dtype_names": ["bfloat16", ...], "shapes": [[...], ...], "packed": bool,
     "tensor_sizes": [...],                     # packed only: bytes of each tensor in the buffer
     "ipc_handles_pickled": base64(pickle(handles))}

The engine refuses to unpickle unless it runs with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
Nothing here needs a GPU: the handles are opaque tuples, so this module is tested on CPU.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from vime.wire.rollout import EngineInfo

Handles = dict[str, Any]
"""GPU UUID -> the args of ``torch.multiprocessing.reductions.rebuild_cuda_tensor``."""


class IpcPayloadError(ValueError):
    """Rank exports that cannot form one update (different buckets, lengths that do not match)."""


@dataclass(frozen=True)
class RankGpu:
    """Where one trainer rank lives: its GPU's UUID and physical index (None when unknown)."""

    rank: int
    gpu_uuid: str
    physical_gpu: int | None = None


@dataclass(frozen=True)
class RankExport:
    """One rank's share of one bucket, as the rank-side exporter returns it."""

    index: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool
    handles: Handles | list[Handles]
    """Packed: one dict for the bucket's buffer; unpacked: one dict per tensor."""
    tensor_sizes: list[int] | None = None
    nbytes: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankExport:
        return cls(**d)


def encode_handles(handles: Handles | list[Handles]) -> str:
    """base64(pickle(handles)): the ``ipc_handles_pickled`` field vLLM's HTTP route decodes."""
    return base64.b64encode(pickle.dumps(handles)).decode("ascii")


def decode_handles(text: str) -> Any:
    """The inverse of `encode_handles` (what the engine does; used by tests)."""
    return pickle.loads(base64.b64decode(text))


def ranks_for_engine(engine: EngineInfo, ranks: Sequence[RankGpu]) -> list[int]:
    """The ranks whose GPU belongs to ``engine``; all ranks when that cannot be told.

    Each vLLM worker only reads its own GPU's entry, so extra entries are harmless; missing ones
    are not, hence the fall-back to every rank.
    """
    gpus = set(engine.gpu_ids)
    chosen = [r.rank for r in ranks if r.physical_gpu is not None and r.physical_gpu in gpus]
    return chosen or [r.rank for r in ranks]


def merge_handles(exports: Sequence[RankExport]) -> Handles | list[Handles]:
    """One handle dict (packed) or one per tensor (unpacked), with every rank's GPU in it."""
    first = exports[0]
    if first.packed:
        merged: Handles = {}
        for e in exports:
            merged.update(cast(Handles, e.handles))
        return merged
    per_tensor: list[Handles] = [{} for _ in first.names]
    for e in exports:
        for i, h in enumerate(cast(list[Handles], e.handles)):
            per_tensor[i].update(h)
    return per_tensor


def check_exports(exports: Sequence[RankExport]) -> None:
    """Every rank exported the same bucket (same tensors, same layout)."""
    if not exports:
        raise IpcPayloadError("no rank exported this bucket")
    first = exports[0]
    n = len(first.names)
    if len(first.dtype_names) != n or len(first.shapes) != n:
        raise IpcPayloadError(f"bucket {first.index}: names, dtype_names and shapes differ in length")
    if first.packed and (first.tensor_sizes is None or len(first.tensor_sizes) != n):
        raise IpcPayloadError(f"bucket {first.index}: a packed bucket needs one tensor size per tensor")
    for e in exports:
        same = (e.index, e.names, e.shapes, e.dtype_names, e.packed, e.tensor_sizes)
        if same != (
            first.index,
            first.names,
            first.shapes,
            first.dtype_names,
            first.packed,
            first.tensor_sizes,
        ):
            raise IpcPayloadError(f"ranks disagree on bucket {first.index}: the export is not collective")
        if not e.packed and len(e.handles) != n:
            raise IpcPayloadError(f"bucket {first.index}: {len(e.handles)} handles for {n} tensors")


def build_update_info(exports: Sequence[RankExport]) -> dict[str, Any]:
    """vLLM's ``update_info`` for one bucket from the exports of the ranks on one engine's GPUs."""
    check_exports(exports)
    first = exports[0]
    info: dict[str, Any] = {
        "names": list(first.names),
        "dtype_names": list(first.dtype_names),
        "shapes": [list(s) for s in first.shapes],
        "packed": first.packed,
    }
    if first.packed:
        info["tensor_sizes"] = list(first.tensor_sizes or [])
    info["ipc_handles_pickled"] = encode_handles(merge_handles(exports))
    return info


class IpcBucket:
    """One bucket as every rank exported it; builds (and caches) each engine's payload."""

    def __init__(self, exports: Sequence[RankExport], ranks: Sequence[RankGpu]) -> None:
        check_exports(exports)
        self.exports = {r.rank: e for r, e in zip(ranks, exports, strict=True)}
        self.ranks = list(ranks)
        first = exports[0]
        self.index = first.index
        self.nbytes = first.nbytes
        self.num_tensors = len(first.names)
        self._cache: dict[tuple[int, ...], dict[str, Any]] = {}

    def update_info(self, engine: EngineInfo) -> dict[str, Any]:
        chosen = tuple(ranks_for_engine(engine, self.ranks))
        if chosen not in self._cache:
            self._cache[chosen] = build_update_info([self.exports[r] for r in chosen])
        return self._cache[chosen]
