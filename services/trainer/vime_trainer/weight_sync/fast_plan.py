"""The fast weight load's plan: which HF tensors make up each vLLM parameter, and in what byte order.

The engine side (``vime_rollout.vllm_ext.fast_loader``) reports its parameters: name, the HF
tensors each is made of (``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up), bytes and dtype.
`FastPlan` checks that layout once, and `group_into_params` turns the trainer's stream of HF
tensors into vLLM parameters — the parts of each, back to back in the stored order, which for a
row-major fused weight is the concatenation vLLM holds — grouped into buckets of at most
``bucket_bytes``. Pure logic: tested on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


class FastPlanError(ValueError):
    """The engine's layout cannot be written by the fast path (the stock path must be used)."""


@dataclass(frozen=True)
class FastParam:
    name: str
    hf: tuple[str, ...]
    nbytes: int
    dtype: str


@dataclass(frozen=True)
class FastPlan:
    """vLLM's parameters, and for each HF name the parameter it belongs to."""

    params: dict[str, FastParam]
    owner: dict[str, str]

    @classmethod
    def from_layout(cls, layout: Sequence[dict[str, Any]]) -> FastPlan:
        params: dict[str, FastParam] = {}
        owner: dict[str, str] = {}
        for entry in layout:
            name = str(entry["name"])
            if not entry.get("writable", False):
                raise FastPlanError(f"{name} cannot be written in place (not a plain contiguous tensor)")
            p = FastParam(name, tuple(entry["hf"]), int(entry["nbytes"]), str(entry["dtype"]))
            params[name] = p
            for hf in p.hf:
                if hf in owner:
                    raise FastPlanError(f"{hf} belongs to both {owner[hf]} and {name}")
                owner[hf] = name
        if not params:
            raise FastPlanError("the engine reported no parameters")
        return cls(params, owner)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, to send to the trainer ranks."""
        return {"params": [[p.name, list(p.hf), p.nbytes, p.dtype] for p in self.params.values()]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FastPlan:
        layout = [
            {"name": n, "hf": hf, "nbytes": b, "dtype": d, "writable": True} for n, hf, b, d in data["params"]
        ]
        return cls.from_layout(layout)


@dataclass
class ParamBucket:
    """Whole vLLM parameters, each as its HF parts in order."""

    index: int
    params: list[tuple[str, list[torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, parts in self.params for t in parts)

    def pack(self) -> tuple[torch.Tensor, list[list[Any]]]:
        """One uint8 buffer (on the tensors' device) and ``[name, offset, nbytes]`` per parameter."""
        flat = [
            (name, [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in parts])
            for name, parts in self.params
        ]
        total = sum(f.numel() for _, fs in flat for f in fs)
        device = self.params[0][1][0].device if self.params else torch.device("cpu")
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        entries, offset = [], 0
        for name, fs in flat:
            start = offset
            for f in fs:
                buffer[offset : offset + f.numel()].copy_(f)
                offset += f.numel()
            entries.append([name, start, offset - start])
        return buffer, entries


def group_into_params(
    tensors: Iterator[tuple[str, torch.Tensor]], plan: FastPlan, bucket_bytes: int
) -> Iterator[ParamBucket]:
    """HF tensors (any order within a layer) → buckets of whole vLLM parameters, checked against the plan."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    bucket = ParamBucket(0, [])
    for hf_name, tensor in tensors:
        owner = plan.owner.get(hf_name)
        if owner is None:
            raise FastPlanError(f"the trainer exports {hf_name}, which the engine has no parameter for")
        parts = pending.setdefault(owner, {})
        parts[hf_name] = tensor
        param = plan.params[owner]
        if len(parts) < len(param.hf):
            continue
        ordered = [parts[h] for h in param.hf]
        _check(param, ordered)
        del pending[owner]
        done.add(owner)
        size = param.nbytes
        if bucket.params and bucket.nbytes + size > bucket_bytes:
            yield bucket
            bucket = ParamBucket(bucket.index + 1, [])
        bucket.params.append((owner, ordered))
    if bucket.params:
        yield bucket
    missing = sorted(set(plan.params) - done)
    if missing:
        raise FastPlanError(f"no weights pushed for {len(missing)} engine parameter(s), e.g. {missing[:3]}")


def _check(param: FastParam, parts: list[torch.Tensor]) -> None:
    nbytes = sum(t.numel() * t.element_size() for t in parts)
    if nbytes != param.nbytes:
        raise FastPlanError(
            f"{param.name}: the trainer has {nbytes} bytes for a {param.nbytes}-byte parameter"
        )
    dtypes = {str(t.dtype).removeprefix("torch.") for t in parts}
    if dtypes != {param.dtype}:
        raise FastPlanError(
            f"{param.name}: trainer dtype {sorted(dtypes)} but the engine holds {param.dtype}"
        )
