"""The contract suite's CUDA IPC weight pusher, for real vLLM (``VIME_CONTRACT_PUSHER=ipc_pusher:make_pusher``).

It sends what the trainer's ``ipc`` transport sends (seed steps 47–51): each bucket of tensors is
copied onto this process's GPU, packed back to back exactly as vLLM's packed consumer cuts it
(`ipc_rank.pack_like_vllm`), shared by a CUDA IPC handle keyed by the GPU's UUID, and posted as
the ``update_info`` the trainer builds (`ipc_payload.build_update_info`). The buffer stays alive
until ``/update_weights`` returns, which vLLM answers once the weights are loaded.

Tensors are cast to the served model's dtype (``VIME_IPC_PUSHER_DTYPE``, default: the
``dtype`` in ``$VIME_CONTRACT_MODEL_DIR/config.json``, else bfloat16) before they are shared.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from contract_pushers import buckets

from vime.clients.base import ServiceCallError
from vime.clients.engine import EngineClient

BUCKET_BYTES = 64 << 20


def served_dtype() -> torch.dtype:
    """The dtype the engine holds its weights in."""
    name = os.environ.get("VIME_IPC_PUSHER_DTYPE")
    model_dir = os.environ.get("VIME_CONTRACT_MODEL_DIR")
    if not name and model_dir and (Path(model_dir) / "config.json").is_file():
        config = json.loads((Path(model_dir) / "config.json").read_text())
        name = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, name or "bfloat16")


class IpcPusher:
    """One weight-update session per push; one packed CUDA IPC bucket per ``/update_weights``."""

    def __init__(self, bucket_bytes: int = BUCKET_BYTES, dtype: torch.dtype | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the IPC pusher needs a CUDA GPU shared with the engine")
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype or served_dtype()
        self.device = torch.cuda.current_device()
        self.gpu_uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        self.pushes = 0

    async def push(
        self, engine: EngineClient, tensors: Mapping[str, torch.Tensor], *, version: str | None = None
    ) -> None:
        self.pushes += 1
        await engine.init_weight_transfer_engine({})
        await engine.start_weight_update()
        try:
            for index, bucket in enumerate(buckets(tensors, self.bucket_bytes)):
                await self._send(engine, index, bucket)
        except BaseException:
            with contextlib.suppress(ServiceCallError):  # the engine may have ended the session already
                await engine.finish_weight_update()
            raise
        finally:
            torch.cuda.ipc_collect()
        await engine.finish_weight_update(version)

    async def _send(self, engine: EngineClient, index: int, bucket: Mapping[str, torch.Tensor]) -> None:
        from torch.multiprocessing.reductions import reduce_tensor
        from vime_trainer.weight_sync.ipc_payload import RankExport, build_update_info
        from vime_trainer.weight_sync.ipc_rank import pack_like_vllm

        on_gpu = [
            t.detach().to(f"cuda:{self.device}", dtype=self.dtype).contiguous() for t in bucket.values()
        ]
        buffer, sizes = pack_like_vllm(on_gpu)
        torch.cuda.current_stream().synchronize()  # the copies are done before the engine reads
        export = RankExport(
            index=index,
            names=list(bucket),
            dtype_names=[str(t.dtype).removeprefix("torch.") for t in on_gpu],
            shapes=[list(t.shape) for t in on_gpu],
            packed=True,
            handles={self.gpu_uuid: reduce_tensor(buffer)[1]},
            tensor_sizes=sizes,
            nbytes=int(buffer.numel()),
        )
        await engine.update_weights(build_update_info([export]))
        del buffer, on_gpu  # loaded: the engine returned from /update_weights


def make_pusher(work_dir: Path) -> IpcPusher:
    """The factory ``VIME_CONTRACT_PUSHER`` names (``work_dir`` is unused: nothing touches disk)."""
    return IpcPusher()
