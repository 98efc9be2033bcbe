"""A worker extension that loads pushed weights by copying bytes straight into the parameters
(``engine.weight_load: direct``; the wire and the checksum are `vime.wire.direct_load`).

vLLM 0.26's ``/update_weights`` hands every tensor to the model's weight loaders through its
layer-wise reload machinery (parameters moved to the meta device, re-materialised per layer,
loaded, processed, copied back): for a Qwen3-4B shape that is ~0.2 s, while the same 8.8 GB copy on
the GPU takes ~5 ms. For dense, unquantised models whose parameters are plain tensors, the pushed
bytes can go directly into the parameters' storage — provided the trainer lays out each
parameter's bytes as the engine holds them: the fused ``qkv_proj`` is q, k, v back to back and
``gate_up_proj`` gate then up (the model's ``packed_modules_mapping``), which is exactly the HF
tensors' bytes concatenated in that order.

vLLM mixes this class into its worker with ``--worker-extension-cls`` (``self`` is the worker:
``self.model_runner.get_model()``, ``self.device``, ``self.vllm_config``); the reference engine
does the same with its own worker (`vime_rollout.reference_engine.worker`). The trainer's staging
buffers are opened here for one push and closed after it; each parameter's byte view is recorded
at the first open after the engine started and replayed on every load. Each open reads the
model's parameters again, and a view whose parameter storage moved since (a sleep that reallocated
it) is recorded again before it is written, so a load never writes into memory the model no longer
uses, and the checksum always reads the parameters as the model holds them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vime.wire.direct_load import checksum, decode_load, decode_open


def hf_parts(name: str, packed: Mapping[str, Sequence[str]]) -> list[str]:
    """The HF tensor names a parameter is made of, in storage order (itself when not fused)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            return [".".join([*parts[:i], sub, *parts[i + 1 :]]) for sub in packed[part]]
    return [name]


def param_refusal(p: torch.Tensor) -> str | None:
    """Why ``p`` cannot be written as raw bytes (None when it can)."""
    if p.is_meta:
        return "on the meta device"
    if type(p.data) is not torch.Tensor:
        return f"a {type(p.data).__name__}, not a plain tensor"
    if not p.is_contiguous():
        return "not contiguous"
    if not p.dtype.is_floating_point:
        return f"dtype {str(p.dtype).removeprefix('torch.')} (quantised?)"
    return None


def model_layout(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Every parameter of ``model`` as the trainer needs it to lay out a push."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    out = []
    for name, p in model.named_parameters():
        why = param_refusal(p)
        out.append(
            {
                "name": name,
                "hf": hf_parts(name, packed),
                "shape": list(p.shape),
                "dtype": str(p.dtype).removeprefix("torch."),
                "nbytes": p.numel() * p.element_size(),
                "writable": why is None,
                "why": why,
            }
        )
    return out


def engine_refusal(worker: Any) -> str | None:
    """Why the engine as a whole cannot be loaded directly (quantised, split over workers), or None."""
    cfg = getattr(worker, "vllm_config", None)
    quant = getattr(getattr(cfg, "model_config", None), "quantization", None)
    if quant:
        return f"the model is quantised ({quant}): its parameters are not the trainer's tensors"
    par = getattr(cfg, "parallel_config", None)
    tp = int(getattr(par, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(par, "pipeline_parallel_size", 1) or 1)
    if tp * pp > 1:
        return f"tensor_parallel_size={tp}, pipeline_parallel_size={pp}: the direct load needs every parameter whole on one worker"
    return None


def open_buffer(spec: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    """A staging buffer (uint8) the trainer shares: its CUDA IPC handle for this GPU, or a shm file."""
    nbytes = int(spec["nbytes"])
    if "shm" in spec:
        return torch.from_file(str(spec["shm"]), shared=True, size=nbytes, dtype=torch.uint8)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    handles = spec["cuda_ipc"]
    uuid = str(torch.cuda.get_device_properties(device.index).uuid)
    if uuid not in handles:
        raise ValueError(f"no IPC handle for this worker's GPU {uuid}; have {sorted(handles)}")
    args = list(handles[uuid])
    args[6] = device.index  # the receiver's device index, as vLLM's own consumer does
    buffer: torch.Tensor = rebuild_cuda_tensor(*args)
    if buffer.numel() != nbytes:
        raise ValueError(f"the shared buffer has {buffer.numel()} bytes, {nbytes} announced")
    return buffer


def _byte_view(p: torch.Tensor) -> torch.Tensor:
    return p.data.view(-1).view(torch.uint8)


@dataclass
class ParamViews:
    """The served model's parameters and their byte views, recorded once per engine start."""

    params: dict[str, torch.nn.Parameter]
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    rerecorded: int = 0

    def view(self, name: str) -> torch.Tensor:
        """The current byte view of ``name``, recorded again if its storage moved since."""
        param = self.params.get(name)
        if param is None:
            raise KeyError(f"no parameter {name!r} in the served model")
        view = self.views.get(name)
        if view is None or view.data_ptr() != param.data.data_ptr() or view.numel() != param.data.nbytes:
            if view is not None:
                self.rerecorded += 1
            view = self.views[name] = _byte_view(param)
        return view


@dataclass
class DirectSession:
    """One push's staging buffers, opened from the trainer session ``session``, and the views
    they are copied into."""

    session: str
    buffers: list[torch.Tensor]
    views: ParamViews


def copy_into(
    views: ParamViews, buffer: torch.Tensor, entries: Sequence[Sequence[Any]]
) -> list[torch.Tensor]:
    """Copy ``buffer[offset : offset + nbytes]`` into each named parameter; the views written, in order."""
    dsts, srcs = [], []
    for name, offset, nbytes in entries:
        dst = views.view(str(name))
        start, n = int(offset), int(nbytes)
        if dst.numel() != n:
            raise ValueError(f"{name}: {n} bytes pushed for a {dst.numel()}-byte parameter")
        if start < 0 or start + n > buffer.numel():
            raise ValueError(
                f"{name}: bytes {start}..{start + n} are outside the {buffer.numel()}-byte buffer"
            )
        dsts.append(dst)
        srcs.append(buffer[start : start + n])
    with torch.no_grad():
        if dsts and all(s.device == dsts[0].device for s in srcs):
            torch._foreach_copy_(dsts, srcs)  # one fused launch per few hundred tensors
        else:
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s)
    return dsts


class DirectLoadExtension:
    """Mixed into the engine's worker by ``--worker-extension-cls`` (``self`` is the worker)."""

    _vime_direct: DirectSession | None = None
    _vime_views: ParamViews | None = None

    def _vime_model(self) -> torch.nn.Module:
        """The bare model (not a CUDA-graph or compile wrapper), as vLLM's own weight transfer gets it."""
        runner = self.model_runner  # type: ignore[attr-defined]
        model: torch.nn.Module = runner.get_model() if hasattr(runner, "get_model") else runner.model
        return model

    def _vime_device(self) -> torch.device:
        device = getattr(self, "device", None)
        if isinstance(device, torch.device):
            return device
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

    def _vime_session(self, session: str) -> DirectSession:
        current: DirectSession | None = getattr(self, "_vime_direct", None)
        if current is None or current.session != session:
            raise RuntimeError(f"direct-load session {session!r} is not open here (engine restarted?)")
        return current

    def vime_direct_layout(self) -> dict[str, Any]:
        return {"params": model_layout(self._vime_model()), "refusal": engine_refusal(self)}

    def _vime_param_views(self) -> ParamViews:
        """The views recorded at earlier opens, over the model's parameters read again (an object
        or a storage replaced since, by vLLM's own loader say, gets its view recorded again)."""
        views: ParamViews = getattr(self, "_vime_views", None) or ParamViews({})
        views.params = dict(self._vime_model().named_parameters())
        for name in views.params:
            views.view(name)
        self._vime_views = views
        return views

    def vime_direct_open(self, payload: str) -> dict[str, Any]:
        data = decode_open(payload)
        self.vime_direct_close()
        views = self._vime_param_views()
        buffers = [open_buffer(spec, self._vime_device()) for spec in data["buffers"]]
        self._vime_direct = DirectSession(str(data["session"]), buffers, views)
        return {"session": str(data["session"]), "buffers": len(buffers), "params": len(views.params)}

    def vime_direct_load(self, payload: str) -> dict[str, Any]:
        req = decode_load(payload)
        state = self._vime_session(str(req["session"]))
        slot = int(req["slot"])
        if not 0 <= slot < len(state.buffers):
            raise ValueError(f"buffer {slot} is not open (have {len(state.buffers)})")
        t0 = time.perf_counter()
        written = copy_into(state.views, state.buffers[slot], req["params"])
        value = checksum(written)  # reads the parameters back; waits for the copies
        return {
            "bucket": int(req["bucket"]),
            "params": len(written),
            "bytes": sum(v.numel() for v in written),
            "checksum": str(value),
            "rerecorded": state.views.rerecorded,
            "seconds": time.perf_counter() - t0,
        }

    def vime_direct_close(self) -> dict[str, Any]:
        """Drop the push's buffers (the trainer frees its side once every engine let go); the
        recorded views stay."""
        self._vime_direct = None
        return {"closed": True}
