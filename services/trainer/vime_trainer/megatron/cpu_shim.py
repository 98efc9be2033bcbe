"""Run megatron-core 0.16.1 on a machine without a GPU: redirect its hard-coded CUDA calls to CPU.

Megatron-core builds tensors with ``device="cuda"`` literals, asks ``torch.cuda.current_device()``
for RoPE frequencies and memory buffers, records CUDA streams in the DDP grad buffers and asserts
``grad.type() == "torch.cuda.FloatTensor"`` before clipping. None of that has a CPU switch, so a
training rank that finds no GPU calls `install_cpu_shim` once, before it builds a model; the model,
loss and optimizer code is then the same as on GPU. The shim is process-wide and irreversible, so
it is installed only inside training-rank processes (Ray actors, spawned tools), never in a test
runner or a service that shares the process with other code, and never when CUDA is available.

What it does (each item is a CUDA site reached by a TP/PP/DP training step of 0.16.1):
- a `TorchFunctionMode` that rewrites ``device="cuda"`` / ``torch.device("cuda")`` / bare int
  devices to CPU, makes ``Tensor.cuda()`` a no-op and ``Tensor.to("cuda")`` a CPU move;
- ``Tensor.type()`` (no argument) reports the CUDA type name, so the fp32 clip-grad assertion
  holds and gradient clipping works on CPU as on GPU;
- ``torch.cuda.current_device`` returns the CPU device; ``synchronize`` / ``empty_cache`` do
  nothing; ``Stream`` / ``Event`` / ``current_stream`` / ``default_stream`` / ``stream`` are no-op
  objects (``Stream`` and ``Event`` stay classes: transformers uses them in annotations);
- ``torch.cuda.get_rng_state`` returns an empty state (activation recomputation saves it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def _to_cpu(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):  # a bare int means cuda:<int>
        return "cpu"
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], str | torch.device):
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


class _NoopStream:
    """Stands in for torch.cuda.Stream and torch.cuda.Event."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _NoopStream:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


def install_cpu_shim() -> None:
    """Install the CUDA→CPU redirections for this process (idempotent; refused when CUDA works)."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the CPU shim must not be installed on a machine with a usable GPU")
    cuda: Any = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.current_stream = lambda *a, **k: _NoopStream()
    cuda.default_stream = lambda *a, **k: _NoopStream()
    cuda.stream = lambda *a, **k: _NoopStream()
    cuda.Stream = _NoopStream
    cuda.Event = _NoopStream
    # Activation recomputation saves the CUDA RNG state with the CPU one (setting it back is a
    # lazy call that never runs without CUDA); dropout is off, so an empty state loses nothing.
    cuda.get_rng_state = cuda.random.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    _CudaToCpu().__enter__()  # stays active for the rest of the process
    _installed = True


def shim_installed() -> bool:
    """Whether this process runs Megatron through the CPU shim."""
    return _installed
