"""Pack a stream of named tensors into size-bounded buckets (seed steps 48–50).

A weight push sends one bucket per request, so the exporter yields buckets one at a time and
never holds the whole model twice. A tensor larger than the bucket size travels alone in its own
bucket. ``Bucket.flatten`` gives the packed form (one uint8 buffer plus per-tensor offsets) that a
CUDA-IPC sender shares with a single handle.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

ALIGN = 256  # byte alignment of each tensor in a flattened bucket (any dtype can view it)


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives inside a flattened bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Bucket:
    """Consecutive named tensors whose total size stays under the bucket limit (unless one is larger)."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    index: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def __len__(self) -> int:
        return len(self.names)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(tensor)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.tensors, strict=True))

    def flatten(self) -> tuple[torch.Tensor, list[TensorSpec]]:
        """All tensors copied into one uint8 buffer on their device (each at an ALIGN-byte offset)."""
        if not self.tensors:
            return torch.empty(0, dtype=torch.uint8), []
        specs, offset = [], 0
        for name, t in zip(self.names, self.tensors, strict=True):
            n = t.numel() * t.element_size()
            specs.append(TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, n))
            offset += -(-n // ALIGN) * ALIGN
        buffer = torch.empty(offset, dtype=torch.uint8, device=self.tensors[0].device)
        for spec, t in zip(specs, self.tensors, strict=True):
            buffer[spec.offset : spec.offset + spec.nbytes].copy_(
                t.detach().contiguous().reshape(-1).view(torch.uint8)
            )
        return buffer, specs


def unflatten(buffer: torch.Tensor, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """The named tensors of a flattened bucket (views into ``buffer``)."""
    out = {}
    for s in specs:
        raw = buffer[s.offset : s.offset + s.nbytes]
        out[s.name] = raw.view(getattr(torch, s.dtype)).reshape(s.shape)
    return out


def pack_buckets(named: Iterable[tuple[str, torch.Tensor]], size_bytes: int) -> Iterator[Bucket]:
    """Group ``(name, tensor)`` pairs, in order, into buckets of at most ``size_bytes`` each."""
    if size_bytes < 1:
        raise ValueError(f"bucket size must be positive, got {size_bytes}")
    bucket = Bucket()
    for name, tensor in named:
        n = tensor.numel() * tensor.element_size()
        if len(bucket) and bucket.nbytes + n > size_bytes:
            yield bucket
            bucket = Bucket(index=bucket.index + 1)
        bucket.add(name, tensor)
    if len(bucket):
        yield bucket
