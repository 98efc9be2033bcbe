"""Full HF-named tensors from a TP × PP-sharded model, one parameter at a time (seed step 48).

Collective: every rank of the model-parallel grid calls it with its own shard and receives every
full tensor, in the same order (embeddings, layers 0..L-1, final norm, output layer). Each
pipeline stage first broadcasts its parameters to the other stages of its pipeline group, then
the TP group all-gathers the slices and `tp_layout.unshard` rebuilds the full tensor, which
`hf_mapping.to_hf` renames/splits. Every TP rank ends up with the full tensors on its own device,
which is what a CUDA-IPC push needs (each engine GPU reads from the trainer rank on the same GPU).
The source can be the live parameters or a CPU backup (the model may be asleep during the push).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from vime_trainer.megatron.runtime import RankInfo
from vime_trainer.weights.architecture import Architecture
from vime_trainer.weights.buckets import Bucket, pack_buckets
from vime_trainer.weights.hf_mapping import local_to_global, to_hf
from vime_trainer.weights.tp_layout import unshard


def _stage_entries(
    arch: Architecture, local: Mapping[str, torch.Tensor], offset: int
) -> list[tuple[str, str, tuple[int, ...], torch.dtype]]:
    out = []
    for name, t in local.items():
        full_name = local_to_global(name, offset)
        if full_name == "output_layer.weight" and arch.tie_word_embeddings:
            continue  # a pipeline's copy of the tied embedding: HF stores it once
        out.append((name, full_name, tuple(t.shape), t.dtype))
    return out


def iter_full_params(
    arch: Architecture, local: Mapping[str, torch.Tensor], info: RankInfo, layer_offset: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(global Megatron name, full tensor on this rank's device) for every parameter of the model."""
    device = torch.device(info.device)
    entries = _stage_entries(arch, local, layer_offset)
    if info.pp_size > 1:
        stages: list = [None] * info.pp_size
        dist.all_gather_object(stages, entries, group=ps.get_pipeline_model_parallel_group())
        pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    else:
        stages, pp_ranks = [entries], [info.rank]
    tp_group = ps.get_tensor_model_parallel_group()
    for stage, stage_entries in enumerate(stages):
        for local_name, full_name, shape, dtype in stage_entries:
            if stage == info.pp_rank:
                shard = local[local_name].detach().to(device).contiguous()
            else:
                shard = torch.empty(shape, dtype=dtype, device=device)
            if info.pp_size > 1:
                dist.broadcast(shard, src=pp_ranks[stage], group=ps.get_pipeline_model_parallel_group())
            if info.tp_size > 1:
                parts = [torch.empty_like(shard) for _ in range(info.tp_size)]
                dist.all_gather(parts, shard, group=tp_group)
                yield full_name, unshard(full_name, parts)
            else:
                yield full_name, shard


def iter_hf_tensors(
    arch: Architecture, local: Mapping[str, torch.Tensor], info: RankInfo, layer_offset: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for the whole model, streamed."""
    for name, full in iter_full_params(arch, local, info, layer_offset):
        yield from to_hf(arch, name, full)


def iter_hf_buckets(
    arch: Architecture,
    local: Mapping[str, torch.Tensor],
    info: RankInfo,
    layer_offset: int,
    bucket_bytes: int,
) -> Iterator[Bucket]:
    """HF tensors packed into buckets of at most ``bucket_bytes`` (one oversized tensor travels alone)."""
    yield from pack_buckets(iter_hf_tensors(arch, local, info, layer_offset), bucket_bytes)
