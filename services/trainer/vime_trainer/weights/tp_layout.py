"""How Megatron splits each parameter across tensor-parallel ranks, and how to undo it.

Column-parallel layers (``linear_qkv``, ``linear_fc1``, the vocab-parallel embedding and output
layer) are split along dim 0, row-parallel ones (``linear_proj``, ``linear_fc2``) along dim 1,
norms are replicated. ``linear_fc1`` is fused *per rank*: rank r holds ``[gate_r; up_r]``, not a
plain slice of ``[gate; up]``. ``linear_qkv`` slices hold whole query groups because of its
per-group layout, so a plain dim-0 split is right for it.
"""

from __future__ import annotations

import torch

_DIM0 = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")
_DIM1 = ("linear_proj.weight", "linear_fc2.weight")
_FC1 = "linear_fc1.weight"


def split_dim(name: str) -> int | None:
    """The dimension ``name`` is split on under TP, or None when it is replicated."""
    if name.endswith(_DIM0) or name.endswith(_FC1):
        return 0
    if name.endswith(_DIM1):
        return 1
    return None


def shard(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s slice of the full parameter ``name`` (a contiguous copy)."""
    dim = split_dim(name)
    if dim is None or tp == 1:
        return full.clone().contiguous()
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of {tuple(full.shape)} does not split over TP={tp}")
    if name.endswith(_FC1):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[tp_rank], up.chunk(tp, 0)[tp_rank]], dim=0).contiguous()
    return full.chunk(tp, dim=dim)[tp_rank].clone().contiguous()


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full parameter from every TP rank's slice, in rank order."""
    dim = split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith(_FC1):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)
