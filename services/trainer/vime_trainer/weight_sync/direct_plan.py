"""The direct weight load's plan: which HF tensors make up each engine parameter, checked once against
what the trainer exports, and the buckets they travel in.

The engine's worker extension (``vime_rollout.vllm_ext.direct_load``) reports its parameters: name,
the HF tensors each is made of in storage order (``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate,
up), bytes, dtype, and whether it is a plain tensor. `DirectPlan.from_layout` and
`DirectPlan.check_export` refuse — before anything is paused — every case where copying the
trainer's bytes would not give the engine the trainer's weights (quantised or split engines,
parameters that are not plain tensors, a missing or extra tensor, another size or dtype);
`group_into_buckets` then turns the trainer's stream of HF tensors into whole engine parameters,
the parts of each back to back (for a row-major fused weight, exactly what the engine holds),
grouped into buckets that fit one staging buffer. Pure logic: tested on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vime.wire.direct_load import aligned


class DirectLoadRefused(ValueError):
    """The engines cannot be loaded directly; the message says why (the push uses vLLM's loader)."""


@dataclass(frozen=True)
class EngineParam:
    name: str
    hf: tuple[str, ...]
    nbytes: int
    dtype: str


@dataclass(frozen=True)
class DirectPlan:
    """The engine's parameters in its order, and for each HF name the parameter it belongs to."""

    params: dict[str, EngineParam]
    owner: dict[str, str]

    @classmethod
    def from_layout(cls, layout: Sequence[Mapping[str, Any]]) -> DirectPlan:
        params: dict[str, EngineParam] = {}
        owner: dict[str, str] = {}
        for entry in layout:
            name = str(entry["name"])
            if not entry.get("writable", False):
                why = entry.get("why") or "not a plain contiguous tensor"
                raise DirectLoadRefused(f"the engine's {name} cannot be written in place: {why}")
            p = EngineParam(name, tuple(entry["hf"]), int(entry["nbytes"]), str(entry["dtype"]))
            params[name] = p
            for hf in p.hf:
                if hf in owner:
                    raise DirectLoadRefused(f"{hf} belongs to both {owner[hf]} and {name}")
                owner[hf] = name
        if not params:
            raise DirectLoadRefused("the engine reported no parameters")
        return cls(params, owner)

    def check_export(self, export: Mapping[str, tuple[Sequence[int], str]]) -> None:
        """Refuse unless the trainer's HF tensors (name → shape, dtype) fill every parameter exactly."""
        extra = sorted(n for n in export if n not in self.owner)
        if extra:
            raise DirectLoadRefused(
                f"the trainer exports {len(extra)} tensor(s) the engine has no parameter for, e.g. {extra[:3]}"
            )
        for p in self.params.values():
            missing = [h for h in p.hf if h not in export]
            if missing:
                raise DirectLoadRefused(
                    f"the engine's {p.name} needs {missing}, which the trainer does not export"
                )
            dtypes = {export[h][1] for h in p.hf}
            if dtypes != {p.dtype}:
                raise DirectLoadRefused(
                    f"the engine holds {p.name} in {p.dtype}, the trainer exports {sorted(dtypes)}"
                )
            size = torch.empty(0, dtype=getattr(torch, p.dtype)).element_size()
            nbytes = sum(_numel(export[h][0]) * size for h in p.hf)
            if nbytes != p.nbytes:
                raise DirectLoadRefused(
                    f"the engine's {p.name} has {p.nbytes} bytes, the trainer's {'+'.join(p.hf)} {nbytes}"
                )

    def staging(self, bucket_bytes: int) -> tuple[int, int]:
        """How many staging buffers, of how many bytes: one for a model that fits a bucket, else
        two of ``bucket_bytes`` (no less than the largest parameter), so that the trainer packs
        one while the engines copy out of the other. One buffer the model's size was measured
        slower for the 0.6B shape on an H100 (update 0.108–0.127 s against ~0.095 s alternating):
        packing and loading then no longer overlap."""
        sizes = [aligned(p.nbytes) for p in self.params.values()]
        if sum(sizes) <= bucket_bytes:
            return 1, sum(sizes)
        return 2, max(bucket_bytes, max(sizes))

    def to_dict(self) -> dict[str, Any]:
        """Plain data, to send to the trainer ranks."""
        return {"params": [[p.name, list(p.hf), p.nbytes, p.dtype] for p in self.params.values()]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DirectPlan:
        layout = [
            {"name": n, "hf": hf, "nbytes": b, "dtype": d, "writable": True} for n, hf, b, d in data["params"]
        ]
        return cls.from_layout(layout)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclass
class ParamBucket:
    """Whole engine parameters, each as its HF parts in storage order."""

    index: int
    params: list[tuple[str, list[torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, parts in self.params for t in parts)

    def entries(self) -> list[list[Any]]:
        """``[name, offset, nbytes]`` of each parameter in a staging buffer (ALIGN-aligned offsets)."""
        out, offset = [], 0
        for name, parts in self.params:
            n = sum(t.numel() * t.element_size() for t in parts)
            out.append([name, offset, n])
            offset += aligned(n)
        return out

    def pack_into(self, buffer: torch.Tensor) -> list[list[Any]]:
        """Copy the parts into ``buffer`` (uint8) at `entries`' offsets; returns the entries."""
        entries = self.entries()
        for (_, parts), (_, offset, _) in zip(self.params, entries, strict=True):
            at = int(offset)
            for t in parts:
                n = t.numel() * t.element_size()
                buffer[at : at + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
                at += n
        return entries


def group_into_buckets(
    tensors: Iterator[tuple[str, torch.Tensor]], plan: DirectPlan, buffer_bytes: int
) -> Iterator[ParamBucket]:
    """HF tensors (parts of a parameter in any order) → buckets of whole parameters that fit ``buffer_bytes``."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    bucket, used = ParamBucket(0, []), 0
    for hf_name, tensor in tensors:
        owner = plan.owner.get(hf_name)
        if owner is None:
            raise DirectLoadRefused(f"the trainer exports {hf_name}, which the engine has no parameter for")
        parts = pending.setdefault(owner, {})
        parts[hf_name] = tensor
        param = plan.params[owner]
        if len(parts) < len(param.hf):
            continue
        ordered = [parts[h] for h in param.hf]
        nbytes = sum(t.numel() * t.element_size() for t in ordered)
        dtypes = {str(t.dtype).removeprefix("torch.") for t in ordered}
        if nbytes != param.nbytes or dtypes != {param.dtype}:
            raise DirectLoadRefused(
                f"{owner}: the trainer has {nbytes} bytes of {sorted(dtypes)} for {param.nbytes} bytes of {param.dtype}"
            )
        del pending[owner]
        done.add(owner)
        size = aligned(param.nbytes)
        if size > buffer_bytes:
            raise DirectLoadRefused(
                f"{owner} ({param.nbytes} bytes) does not fit a {buffer_bytes}-byte buffer"
            )
        if bucket.params and used + size > buffer_bytes:
            yield bucket
            bucket, used = ParamBucket(bucket.index + 1, []), 0
        bucket.params.append((owner, ordered))
        used += size
    if bucket.params:
        yield bucket
    missing = sorted(set(plan.params) - done)
    if missing:
        raise DirectLoadRefused(
            f"no weights pushed for {len(missing)} engine parameter(s), e.g. {missing[:3]}"
        )
