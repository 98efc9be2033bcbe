"""Read and write Hugging Face checkpoints (safetensors, single file or sharded with an index).

Reading is lazy and per tensor, so a training rank loads only the tensors it holds. Writing
streams: tensors are packed into shard files as they arrive, then the index is written, and the
non-weight files (config, tokenizer, generation config) are copied from a base checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vime_trainer.weights.bucket_files import _owned_cpu
from vime_trainer.weights.buckets import pack_buckets

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_COPY_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".py")


class HFReader:
    """Lazy tensor access to an HF checkpoint directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            with safe_open(str(self.path / SINGLE), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE)
        else:
            raise FileNotFoundError(f"{self.path} holds neither {SINGLE} nor {INDEX}")
        self.weight_map = weight_map
        self._handles: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        """One tensor by HF name (KeyError naming the checkpoint when absent)."""
        file = self.weight_map.get(name)
        if file is None:
            raise KeyError(f"tensor {name!r} is not in the checkpoint {self.path}")
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file].get_tensor(name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: self.get(n) for n in self.names()}


def save_hf_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    base_dir: str | Path | None = None,
    shard_bytes: int = 4 << 30,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``tensors`` as an HF checkpoint in ``out_dir``; copy config/tokenizer files from ``base_dir``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if base_dir is not None:
        for f in Path(base_dir).iterdir():
            if f.is_file() and f.suffix in _COPY_SUFFIXES and f.name != INDEX:
                shutil.copy2(f, out / f.name)
    cast = ((n, t.to(dtype)) for n, t in tensors) if dtype is not None else iter(tensors)
    shards = list(_write_shards(pack_buckets(cast, shard_bytes), out, save_file))
    if len(shards) == 1:
        (out / shards[0][0]).rename(out / SINGLE)
    else:
        total = sum(size for _, size, _ in shards)
        weight_map = {name: file for file, _, names in shards for name in names}
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return out


def _write_shards(buckets: Iterable[Any], out: Path, save_file: Any) -> Iterable[tuple[str, int, list[str]]]:
    files = []
    for bucket in buckets:
        name = f"model-{bucket.index + 1:05d}.safetensors"
        save_file({n: _owned_cpu(t) for n, t in bucket.state_dict().items()}, str(out / name))
        files.append((name, bucket.nbytes, list(bucket.names)))
    total = len(files)
    for i, (name, size, names) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{total:05d}.safetensors" if total > 1 else name
        if final != name:
            (out / name).rename(out / final)
        yield final, size, names
