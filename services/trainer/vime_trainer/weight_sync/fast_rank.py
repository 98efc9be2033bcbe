"""The rank side of the fast weight load: runs inside each training rank's Ray actor (as `ipc_rank`).

Every rank streams its full HF tensors (collective, as for the stock push), `fast_plan` groups
them into whole vLLM parameters, and each bucket is packed into one fresh GPU buffer in vLLM's
byte order and shared by CUDA IPC. The buffer is kept until the driver asks for the next bucket,
which it does only after every engine has copied the current one (``vime_fast_load`` returns
after its copies are done).
"""

from __future__ import annotations

from typing import Any

import torch

from vime_trainer.weight_sync.fast_plan import FastPlan, ParamBucket, group_into_params
from vime_trainer.weight_sync.ipc_rank import close_export, next_export, open_export


class FastExporter:
    def __init__(self, buckets: Any, gpu_uuid: str) -> None:
        self.buckets = buckets
        self.gpu_uuid = gpu_uuid
        self.held: torch.Tensor | None = None

    def next(self) -> dict[str, Any] | None:
        self.held = None  # every engine copied the previous bucket before the driver asked again
        bucket: ParamBucket | None = next(self.buckets, None)
        if bucket is None:
            return None
        from torch.multiprocessing.reductions import reduce_tensor

        buffer, entries = bucket.pack()
        torch.cuda.current_stream().synchronize()  # packed before an engine reads
        self.held = buffer
        return {
            "index": bucket.index,
            "handles": {self.gpu_uuid: reduce_tensor(buffer)[1]},
            "params": entries,
            "nbytes": int(buffer.numel()),
        }

    def close(self) -> None:
        self.held = None
        close = getattr(self.buckets, "close", None)
        if close is not None:
            close()


def fast_open(rank: Any, plan: dict[str, Any], bucket_bytes: int) -> dict[str, Any]:
    """Start a fast export on this rank; returns where it lives (``RankGpu`` fields)."""
    from vime_trainer.megatron.gather import iter_hf_tensors

    if not torch.cuda.is_available():
        raise RuntimeError("the fast weight load needs the trainer ranks on GPUs (CUDA IPC)")

    def exporter(gpu_uuid: str) -> FastExporter:
        tensors = iter_hf_tensors(rank.arch, rank._export_source(), rank.info, rank.layer_offset)
        return FastExporter(group_into_params(tensors, FastPlan.from_dict(plan), bucket_bytes), gpu_uuid)

    return open_export(rank, "fast", exporter)


def fast_next(rank: Any) -> dict[str, Any] | None:
    return next_export(rank, "fast")


def fast_close(rank: Any) -> None:
    """Drop the export, let the driver release the shared blocks, and give the cache back."""
    close_export(rank, "fast")
