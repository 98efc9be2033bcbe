"""A vLLM worker extension that loads pushed weights by copying bytes straight into the parameters.

vLLM 0.26's ``/update_weights`` hands every tensor to the model's weight loaders through its
layer-wise reload machinery (parameters moved to the meta device, re-materialised per layer,
loaded, processed, copied back): for a Qwen3-4B shape that is ~0.2 s, while the same 8.8 GB copy
on the GPU takes ~5 ms. For dense, unquantised models whose parameters are plain tensors, the
pushed bytes can instead go directly into the parameters' storage — provided the trainer lays out
each vLLM parameter's bytes as vLLM holds them: the fused ``qkv_proj`` is q, k, v back to back and
``gate_up_proj`` is gate then up (the model's ``packed_modules_mapping``), which is exactly the
HF tensors' bytes concatenated in that order.

Enable with ``--worker-extension-cls vime_rollout.vllm_ext.fast_loader.FastWeightLoader`` (e.g.
``engine.extra_args``); its methods are then callable through ``POST /collective_rpc``
(``VLLM_SERVER_DEV_MODE=1``):

- ``vime_fast_layout()`` → every parameter: its name, the HF tensors it is made of (in order),
  shape, dtype, bytes, and whether the fast path can write it;
- ``vime_fast_load(payload)`` with ``payload = base64(pickle({"handles": {gpu_uuid: cuda ipc
  args}, "params": [[name, offset, nbytes], ...]}))``: opens the packed buffer by CUDA IPC and
  copies each byte range into its parameter; returns the parameters and bytes written.

Only engines with tensor parallel size 1 are supported (each parameter whole on one GPU); the
trainer side (``vime_trainer.weight_sync.fast_*``) checks the layout before using it and keeps the
stock path otherwise. Nothing here runs unless the extension is configured.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def hf_parts(name: str, packed: Mapping[str, Sequence[str]]) -> list[str]:
    """The HF tensor names a vLLM parameter is made of, in storage order (itself when not fused)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            return [".".join([*parts[:i], sub, *parts[i + 1 :]]) for sub in packed[part]]
    return [name]


def model_layout(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Every parameter of ``model`` as the trainer needs to lay out a push for it."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    out = []
    for name, p in model.named_parameters():
        out.append(
            {
                "name": name,
                "hf": hf_parts(name, packed),
                "shape": list(p.shape),
                "dtype": str(p.dtype).removeprefix("torch."),
                "nbytes": p.numel() * p.element_size(),
                "writable": bool(p.is_contiguous() and type(p.data) is torch.Tensor),
            }
        )
    return out


def copy_into(model: torch.nn.Module, buffer: torch.Tensor, entries: Sequence[Sequence[Any]]) -> int:
    """Copy ``buffer[offset : offset + nbytes]`` (uint8) into each named parameter; returns bytes copied."""
    params = dict(model.named_parameters())
    total = 0
    with torch.no_grad():
        for name, offset, nbytes in entries:
            param = params.get(str(name))
            if param is None:
                raise KeyError(f"no parameter {name!r} in the served model")
            dst = param.data.view(-1).view(torch.uint8)
            if dst.numel() != int(nbytes):
                raise ValueError(f"{name}: {nbytes} bytes pushed for a {dst.numel()}-byte parameter")
            dst.copy_(buffer[int(offset) : int(offset) + int(nbytes)], non_blocking=True)
            total += int(nbytes)
    return total


def open_ipc_buffer(handles: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    """The packed uint8 buffer shared by the trainer rank on this worker's GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid = str(torch.cuda.get_device_properties(device.index).uuid)
    if uuid not in handles:
        raise ValueError(f"no IPC handle for this worker's GPU {uuid}; have {list(handles)}")
    args = list(handles[uuid])
    args[6] = device.index  # the receiver's device index, as vLLM's own consumer does
    return rebuild_cuda_tensor(*args)


class FastWeightLoader:
    """Mixed into vLLM's worker class by ``--worker-extension-cls`` (``self`` is the worker)."""

    def _vime_model(self) -> torch.nn.Module:
        """The bare model (not a CUDA-graph or compile wrapper), as vLLM's own weight transfer gets it."""
        runner = self.model_runner  # type: ignore[attr-defined]
        model: torch.nn.Module = runner.get_model() if hasattr(runner, "get_model") else runner.model
        return model

    def vime_fast_layout(self) -> list[dict[str, Any]]:
        return model_layout(self._vime_model())

    def vime_fast_load(self, payload: str) -> dict[str, int]:
        data = pickle.loads(base64.b64decode(payload))
        device = getattr(self, "device", None) or torch.device("cuda", torch.cuda.current_device())
        buffer = open_ipc_buffer(data["handles"], device)
        nbytes = copy_into(self._vime_model(), buffer, data["params"])
        if buffer.is_cuda:
            torch.cuda.current_stream().synchronize()  # written before the trainer frees the buffer
        del buffer
        return {"params": len(data["params"]), "bytes": nbytes}
