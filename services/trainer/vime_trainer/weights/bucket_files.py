"""One weight bucket as a safetensors file in shared memory: the CPU (and shared-filesystem) push.

The CPU reference engine loads a bucket with ``POST /update_weights {"update_info": {"backend":
"shm", "path": "<file>.safetensors"}}``, one call per bucket, HF names. Files go to ``/dev/shm``
when it exists (RAM-backed, no disk traffic) or to a directory the caller names; they are
written under a temporary name and renamed, so a reader never sees a half-written bucket. The
sender deletes a file once the engines have loaded it.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vime_trainer.weights.buckets import Bucket

SHM_DIR = Path("/dev/shm")


def default_bucket_dir() -> Path:
    """/dev/shm when present, else the system temporary directory."""
    return SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else Path(tempfile.gettempdir())


def _owned_cpu(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor that owns exactly its bytes (safetensors refuses shared storage)."""
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


def write_bucket(bucket: Bucket, directory: str | Path | None = None, prefix: str = "vime-weights") -> Path:
    """Write ``bucket`` as ``<dir>/<prefix>-<index>-<random>.safetensors``; returns the path."""
    out_dir = Path(directory) if directory is not None else default_bucket_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{prefix}-{bucket.index:05d}-{uuid.uuid4().hex[:8]}.safetensors"
    tmp = final.with_suffix(".tmp")
    save_file({n: _owned_cpu(t) for n, t in zip(bucket.names, bucket.tensors, strict=True)}, str(tmp))
    os.replace(tmp, final)
    return final


def read_bucket(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a bucket file, by HF name."""
    return load_file(str(path))


def update_info(path: str | Path) -> dict[str, object]:
    """The ``update_info`` body of the reference engine's ``/update_weights`` for one bucket file."""
    return {"backend": "shm", "path": str(path)}
