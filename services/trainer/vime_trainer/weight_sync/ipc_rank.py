"""The rank side of the CUDA IPC push: runs inside each training rank's Ray actor.

`ActorGroup` stays as it is: the driver runs these functions on every rank with Ray's
``actor.__ray_call__`` (the function receives the rank object). All ranks step together because
``TrainRank.hf_buckets`` is collective (TP all-gather, PP broadcast): each ``ipc_next`` builds the
next bucket of full HF tensors on the rank's own GPU, shares it through CUDA IPC and returns the
handle with the bucket's layout. The rank keeps a bucket alive until the driver asks for the one
after the next: it asks for the next while the engines load the current one, and for the one
after only once every engine has loaded it (vLLM's ``/update_weights`` returns once the weights
are in), so engines never read freed memory; ``ipc_close`` drops the last ones and runs
``torch.cuda.ipc_collect()``.

Each bucket gets a fresh buffer rather than one staging buffer reused for every bucket (vLLM's
own helper): a worker that still holds views of an earlier bucket (vLLM's layerwise reload keeps
them until a layer is complete) then never sees the next bucket's bytes, whatever vLLM version
it runs; torch keeps a shared block alive until its consumer lets go of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from vime_trainer.weights.buckets import Bucket

ReduceFn = Callable[[torch.Tensor], tuple[Any, tuple[Any, ...]]]
"""``torch.multiprocessing.reductions.reduce_tensor``: tensor -> (rebuild fn, rebuild args)."""


def _default_reduce() -> ReduceFn:
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor


class IpcExporter:
    """Turns a rank's bucket stream into IPC handles, one bucket at a time."""

    def __init__(
        self, buckets: Iterator[Bucket], packed: bool, gpu_uuid: str, reduce: ReduceFn | None = None
    ) -> None:
        self.buckets = buckets
        self.packed = packed
        self.gpu_uuid = gpu_uuid
        self.reduce = reduce or _default_reduce()
        self.held: list[torch.Tensor] = []
        """The newest bucket's shared memory; must outlive the engines' read of it."""
        self.previous: list[torch.Tensor] = []
        """The bucket before it, which the engines may still be loading."""

    def next(self) -> dict[str, Any] | None:
        """The next bucket's export (see `ipc_payload.RankExport`), or None after the last."""
        # The engines may still load the newest bucket; the one before it they all loaded.
        self.previous, self.held = self.held, []
        bucket = next(self.buckets, None)
        if bucket is None:
            return None
        tensors = [t.detach().contiguous() for t in bucket.tensors]
        sizes: list[int] | None = None
        if self.packed:
            buffer, sizes = pack_like_vllm(tensors)
            self.held = [buffer]
            handles: Any = {self.gpu_uuid: self.reduce(buffer)[1]}
        else:
            self.held = tensors
            handles = [{self.gpu_uuid: self.reduce(t)[1]} for t in tensors]
        if self.held and self.held[0].is_cuda:
            torch.cuda.current_stream().synchronize()  # the copies are done before an engine reads
        return {
            "index": bucket.index,
            "names": list(bucket.names),
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "packed": self.packed,
            "handles": handles,
            "tensor_sizes": sizes,
            "nbytes": bucket.nbytes,
        }

    def close(self) -> None:
        self.held, self.previous = [], []
        close = getattr(self.buckets, "close", None)
        if close is not None:
            close()


def pack_like_vllm(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The bucket's bytes back to back in one uint8 buffer, no padding, and each tensor's size.

    vLLM's packed consumer cuts the buffer at the running sum of ``tensor_sizes`` and views each
    piece as its dtype and shape, so the layout must be exactly its producer's (``torch.cat`` of
    the flat byte views) — not `Bucket.flatten`, which pads every tensor to an aligned offset.
    """
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    sizes = [f.numel() for f in flat]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    offset = 0
    for f, n in zip(flat, sizes, strict=True):
        buffer[offset : offset + n].copy_(f)
        offset += n
    return buffer, sizes


def physical_gpu(device_index: int) -> int | None:
    """The host's index of this process's CUDA device (Ray narrows CUDA_VISIBLE_DEVICES per rank)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return device_index
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if device_index < len(ids) and ids[device_index].isdigit():
        return int(ids[device_index])
    return None  # UUID or MIG names: the driver falls back to sending every rank's handles


class Exporter(Protocol):
    """One rank's export in progress (`IpcExporter`)."""

    def next(self) -> dict[str, Any] | None: ...

    def close(self) -> None: ...


def _attr(kind: str) -> str:
    return f"_vime_{kind}_exporter"


def open_export(rank: Any, kind: str, make: Callable[[str], Exporter]) -> dict[str, Any]:
    """Replace the rank's ``kind`` export by ``make(gpu_uuid)``; returns where it lives (``RankGpu`` fields).

    The previous export is closed before ``make`` runs, so a new bucket stream never overlaps an old one.
    """
    device = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    close_export(rank, kind)
    setattr(rank, _attr(kind), make(uuid))
    return {"rank": int(rank.rank), "gpu_uuid": uuid, "physical_gpu": physical_gpu(device)}


def next_export(rank: Any, kind: str) -> dict[str, Any] | None:
    """The next bucket of the rank's ``kind`` export (collective: every rank must call it together)."""
    exporter: Exporter | None = getattr(rank, _attr(kind), None)
    if exporter is None:
        raise RuntimeError(f"{kind}_next without {kind}_open")
    return exporter.next()


def close_export(rank: Any, kind: str) -> None:
    """Drop the rank's ``kind`` export and let the CUDA driver release the shared blocks."""
    exporter: Exporter | None = getattr(rank, _attr(kind), None)
    if exporter is not None:
        exporter.close()
        setattr(rank, _attr(kind), None)
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
        if getattr(rank, "asleep", False):
            # A sleeping rank must not keep the push buffers in the allocator's cache: the
            # engines take that memory back for their KV cache next (seed steps 41, 54).
            torch.cuda.empty_cache()


def ipc_open(rank: Any, packed: bool) -> dict[str, Any]:
    """Start an export on this rank; returns where it lives (``RankGpu`` fields)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the ipc weight transport needs the trainer ranks on GPUs (CUDA IPC); "
            "set trainer.weight_transport=shm on hosts without shared GPUs"
        )
    return open_export(rank, "ipc", lambda uuid: IpcExporter(rank.hf_buckets(), packed, uuid))


def ipc_next(rank: Any) -> dict[str, Any] | None:
    """The next bucket's handle on this rank (collective: every rank must call it together)."""
    return next_export(rank, "ipc")


def ipc_close(rank: Any) -> None:
    """Drop the export and let the CUDA driver release the shared blocks."""
    close_export(rank, "ipc")
