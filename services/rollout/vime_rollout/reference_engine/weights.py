"""Weight updates from safetensors files: the ``shm`` transport of vime's trainer.

The trainer writes each bucket of Hugging Face–named tensors (any subset of the model's
parameters, q/k/v and gate/up as separate names) to a safetensors file — in ``/dev/shm`` on one
host, on a shared filesystem across hosts — and sends
``POST /update_weights {"update_info": {"backend": "shm", "path": "<file>.safetensors"}}``.
A bucket is checked whole (names, shapes) before any tensor is copied, so a rejected bucket
leaves the weights untouched. vLLM's own IPC payload (``names``, ``dtype_names``, ``shapes``,
``ipc_handles_pickled``) needs CUDA and is refused here with a message that says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHM_BACKEND = "shm"


class BucketError(ValueError):
    """The update payload or the bucket file is unusable; the message says why."""


def bucket_path(update_info: Any) -> Path:
    """The safetensors file named by an ``update_info`` payload, or BucketError."""
    if isinstance(update_info, list):
        if len(update_info) != 1:
            raise BucketError("the reference engine has world size 1: send one update_info, not a list")
        update_info = update_info[0]
    if not isinstance(update_info, dict):
        raise BucketError("update_info must be an object")
    backend = update_info.get("backend")
    if backend != SHM_BACKEND:
        if "ipc_handles_pickled" in update_info or "ipc_handles" in update_info:
            raise BucketError(
                "CUDA IPC handles cannot be opened by the reference engine (CPU); "
                'send {"backend": "shm", "path": "<file>.safetensors"}'
            )
        raise BucketError(f'update_info.backend must be "{SHM_BACKEND}", got {backend!r}')
    path = update_info.get("path")
    if not isinstance(path, str) or not path:
        raise BucketError("update_info.path must name a .safetensors file")
    file = Path(path)
    if not file.is_file():
        raise BucketError(f"update_info.path {path!r} does not exist or is not a file")
    return file


def read_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the file's header (no data read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as exc:
        raise BucketError(f"{file.name} is not a readable safetensors file: {exc}") from exc


def read_tensors(file: Path) -> dict[str, Any]:
    """Every tensor of the file, on CPU."""
    from safetensors.torch import load_file

    return dict(load_file(str(file), device="cpu"))
