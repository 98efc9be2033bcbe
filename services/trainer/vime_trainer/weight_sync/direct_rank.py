"""The rank side of the direct weight load: runs inside each training rank's Ray actor (as `ipc_rank`).

Each rank allocates its staging buffers for one push (`direct_open`) — one per slot, on its GPU
and shared by CUDA IPC, or, with the shm transport, files in shared memory written by global rank
0 — and frees them after it (`direct_close`, once the engines let go), so a sleeping rank holds
none through the rollout. In the push (`direct_begin`, `direct_next` per bucket, `direct_end`),
every rank streams its full HF tensors (collective, as
for the stock push), `direct_plan.group_into_buckets` groups them into whole engine parameters,
and the bucket is packed into the slot the driver names, then checksummed there. The driver only
names a slot once every engine has finished copying the bucket it held before.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from vime.wire.direct_load import checksum
from vime_trainer.weight_sync.direct_plan import DirectPlan, ParamBucket, group_into_buckets
from vime_trainer.weight_sync.ipc_rank import physical_gpu

BufferKind = Literal["ipc", "shm"]
_ATTR = "_vime_direct_exporter"


class DirectExporter:
    """One rank's staging buffers and the bucket stream of the current push."""

    def __init__(
        self,
        plan: DirectPlan,
        buffer_bytes: int,
        slots: int,
        kind: BufferKind,
        *,
        share: bool,
        directory: str | Path | None = None,
    ) -> None:
        self.plan, self.buffer_bytes = plan, buffer_bytes
        self.buffers: list[torch.Tensor] = []
        self.specs: list[dict[str, Any]] = []
        self.paths: list[Path] = []
        self.stream: Iterator[ParamBucket] | None = None
        if kind == "ipc":
            from torch.multiprocessing.reductions import reduce_tensor

            device = torch.cuda.current_device()
            gpu = str(torch.cuda.get_device_properties(device).uuid)
            for _ in range(slots):
                buffer = torch.empty(buffer_bytes, dtype=torch.uint8, device=f"cuda:{device}")
                self.buffers.append(buffer)
                self.specs.append({"nbytes": buffer_bytes, "cuda_ipc": {gpu: reduce_tensor(buffer)[1]}})
        elif share:
            from vime_trainer.weights.bucket_files import default_bucket_dir

            where = Path(directory) if directory is not None else default_bucket_dir()
            where.mkdir(parents=True, exist_ok=True)
            tag = uuid.uuid4().hex[:12]
            for slot in range(slots):
                path = where / f"vime-direct-{tag}-{slot}.buf"
                self.paths.append(path)
                self.buffers.append(
                    torch.from_file(str(path), shared=True, size=buffer_bytes, dtype=torch.uint8)
                )
                self.specs.append({"nbytes": buffer_bytes, "shm": str(path)})

    def begin(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.end()
        self.stream = group_into_buckets(tensors, self.plan, self.buffer_bytes)

    def next(self, slot: int) -> dict[str, Any] | None:
        """Pack the next bucket into buffer ``slot``: its entries, bytes and checksum (None without
        buffers), and the seconds spent making its HF tensors (``source_s``) and packing and
        checksumming them (``pack_s``)."""
        if self.stream is None:
            raise RuntimeError("direct_next without direct_begin")
        t0 = time.perf_counter()
        bucket = next(self.stream, None)
        if bucket is None:
            return None
        t1 = time.perf_counter()
        value: str | None = None
        if self.buffers:
            buffer = self.buffers[slot]
            entries = bucket.pack_into(buffer)
            value = str(checksum([buffer[o : o + n] for _, o, n in entries]))  # waits for the copies
        else:
            entries = bucket.entries()
        return {
            "index": bucket.index,
            "params": entries,
            "nbytes": bucket.nbytes,
            "checksum": value,
            "source_s": t1 - t0,
            "pack_s": time.perf_counter() - t1,
        }

    def end(self) -> None:
        close = getattr(self.stream, "close", None)
        if close is not None:
            close()
        self.stream = None

    def close(self) -> None:
        self.end()
        self.buffers, self.specs = [], []
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.paths = []


def _exporter(rank: Any) -> DirectExporter:
    exporter: DirectExporter | None = getattr(rank, _ATTR, None)
    if exporter is None:
        raise RuntimeError("the direct load is not open on this rank (direct_open first)")
    return exporter


def direct_spec(rank: Any) -> dict[str, Any]:
    """What this rank exports: every HF tensor's shape and dtype (the plan is checked against it)."""
    from vime_trainer.weights.hf_mapping import hf_shapes

    dtype = str(rank.dtype).removeprefix("torch.")
    return {name: [list(shape), dtype] for name, shape in hf_shapes(rank.arch).items()}


def direct_open(
    rank: Any, plan: dict[str, Any], buffer_bytes: int, slots: int, kind: BufferKind, directory: str | None
) -> dict[str, Any]:
    """Allocate (replacing any earlier) staging buffers; returns where the rank lives and their specs."""
    direct_close(rank)
    on_gpu = torch.cuda.is_available() and str(getattr(rank.info, "device", "")).startswith("cuda")
    if kind == "ipc" and not on_gpu:
        raise RuntimeError("the direct load over CUDA IPC needs the trainer ranks on GPUs")
    share = kind == "ipc" or int(rank.rank) == 0
    exporter = DirectExporter(
        DirectPlan.from_dict(plan), buffer_bytes, slots, kind, share=share, directory=directory
    )
    setattr(rank, _ATTR, exporter)
    device = torch.cuda.current_device() if on_gpu else None
    return {
        "rank": int(rank.rank),
        "gpu_uuid": str(torch.cuda.get_device_properties(device).uuid) if device is not None else "",
        "physical_gpu": physical_gpu(device) if device is not None else None,
        "buffers": exporter.specs,
    }


def direct_begin(rank: Any) -> None:
    from vime_trainer.megatron.gather import iter_hf_tensors

    _exporter(rank).begin(iter_hf_tensors(rank.arch, rank._export_source(), rank.info, rank.layer_offset))


def direct_next(rank: Any, slot: int) -> dict[str, Any] | None:
    """The next bucket packed into ``slot`` (collective: every rank must call it together)."""
    return _exporter(rank).next(slot)


def direct_end(rank: Any) -> None:
    """End this push's stream (the buffers stay until `direct_close`, which also gives the push's
    temporaries back)."""
    exporter: DirectExporter | None = getattr(rank, _ATTR, None)
    if exporter is not None:
        exporter.end()


def direct_close(rank: Any) -> None:
    """Free the staging buffers (and their files); a sleeping rank gives their memory back."""
    exporter: DirectExporter | None = getattr(rank, _ATTR, None)
    if exporter is not None:
        exporter.close()
        setattr(rank, _ATTR, None)
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # buffers an engine released after the rank dropped them
        if getattr(rank, "asleep", False):
            torch.cuda.empty_cache()
