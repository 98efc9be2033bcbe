"""Hugging Face ↔ Megatron (local layer spec) parameter names and layouts, one tensor at a time.

Megatron fuses q, k and v into ``linear_qkv`` laid out *per query group* —
``[q (heads_per_group·head_dim), k (head_dim), v (head_dim)] × groups`` — and gate and up into
``linear_fc1 = [gate; up]``; everything else is a rename. Conversions work on full (unsharded)
tensors with *global* layer indices; `tp_layout` shards and unshards them. Each Megatron tensor
converts to HF on its own (``to_hf``), so an export can stream; the reverse needs the two or three
HF tensors a fused one is made of (``hf_sources`` names them, ``to_mcore`` fuses them).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from vime_trainer.weights.architecture import Architecture

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron per-layer suffix -> HF per-layer suffix, one to one.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_GLOBAL_RENAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
QKV = "self_attention.linear_qkv"
FC1 = "mlp.linear_fc1.weight"


def layer_suffixes(arch: Architecture) -> list[str]:
    """Megatron parameter names inside one decoder layer, in a fixed order."""
    names = ["input_layernorm.weight", f"{QKV}.weight"]
    if arch.qkv_bias:
        names.append(f"{QKV}.bias")
    if arch.qk_layernorm:
        names += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    names += ["self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", FC1, "mlp.linear_fc2.weight"]
    return names


def mcore_names(arch: Architecture) -> list[str]:
    """Every Megatron parameter of the full model (global layer indices), embeddings first."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(arch.num_layers):
        names += [f"decoder.layers.{i}.{s}" for s in layer_suffixes(arch)]
    names.append("decoder.final_layernorm.weight")
    if not arch.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def hf_names(arch: Architecture) -> list[str]:
    """Every tensor an HF checkpoint of ``arch`` stores (tied models store no lm_head)."""
    return [hf for name in mcore_names(arch) for hf in hf_sources(arch, name)]


def hf_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor an HF checkpoint of ``arch`` stores, by name (`hf_names` order)."""
    h, d, ffn = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (ffn, h),
        "mlp.up_proj.weight": (ffn, h),
        "mlp.down_proj.weight": (h, ffn),
    }
    top = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "lm_head.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    return {n: layer[n.split(".", 3)[3]] if n.startswith("model.layers.") else top[n] for n in hf_names(arch)}


def hf_sources(arch: Architecture, name: str) -> list[str]:
    """The HF tensors Megatron parameter ``name`` (global layer index) is built from."""
    if name == "output_layer.weight" and arch.tie_word_embeddings:
        return ["model.embed_tokens.weight"]  # a pipeline's last stage keeps its own copy
    if name in _GLOBAL_RENAMES:
        return [_GLOBAL_RENAMES[name]]
    layer, suffix = _split_layer(name)
    prefix = f"model.layers.{layer}."
    if suffix in _LAYER_RENAMES:
        return [prefix + _LAYER_RENAMES[suffix]]
    if suffix.startswith(QKV + "."):
        kind = suffix.rsplit(".", 1)[1]
        return [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
    if suffix == FC1:
        return [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
    raise KeyError(f"no HF counterpart for Megatron parameter {name!r}")


def to_mcore(arch: Architecture, name: str, sources: list[torch.Tensor]) -> torch.Tensor:
    """Fuse/rename the HF tensors listed by ``hf_sources(arch, name)`` into Megatron's layout."""
    if name.endswith(f"{QKV}.weight") or name.endswith(f"{QKV}.bias"):
        q, k, v = sources
        groups, per = arch.num_query_groups, arch.heads_per_group * arch.head_dim
        tail = q.shape[1:]
        parts = [
            q.reshape(groups, per, *tail),
            k.reshape(groups, arch.head_dim, *tail),
            v.reshape(groups, arch.head_dim, *tail),
        ]
        return torch.cat(parts, dim=1).reshape(-1, *tail)
    if name.endswith(FC1):
        return torch.cat(sources, dim=0)
    (only,) = sources
    return only


def to_hf(arch: Architecture, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """HF names and tensors of one full Megatron parameter (empty for a tied output layer)."""
    if name == "output_layer.weight" and arch.tie_word_embeddings:
        return []
    targets = hf_sources(arch, name)
    if name.endswith(f"{QKV}.weight") or name.endswith(f"{QKV}.bias"):
        per = arch.heads_per_group * arch.head_dim
        tail = tensor.shape[1:]
        grouped = tensor.reshape(arch.num_query_groups, per + 2 * arch.head_dim, *tail)
        parts = grouped.split([per, arch.head_dim, arch.head_dim], dim=1)
        return [(n, p.reshape(-1, *tail)) for n, p in zip(targets, parts, strict=True)]
    if name.endswith(FC1):
        return list(zip(targets, tensor.chunk(2, dim=0), strict=True))
    return [(targets[0], tensor)]


def hf_to_mcore_state(arch: Architecture, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full Megatron state of the model, reading HF tensors through ``get(name)``."""
    return {n: to_mcore(arch, n, [get(s) for s in hf_sources(arch, n)]) for n in mcore_names(arch)}


def mcore_to_hf_state(arch: Architecture, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF state dict of a full Megatron state (the inverse of `hf_to_mcore_state`)."""
    out: dict[str, torch.Tensor] = {}
    for name in mcore_names(arch):
        out.update(to_hf(arch, name, state[name]))
    return out


def local_to_global(name: str, layer_offset: int) -> str:
    """Rename a pipeline stage's local layer index to the global one."""
    match = _LAYER.match(name)
    if not match or not layer_offset:
        return name
    return f"decoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}"


def _split_layer(name: str) -> tuple[int, str]:
    match = _LAYER.match(name)
    if not match:
        raise KeyError(f"no HF counterpart for Megatron parameter {name!r}")
    return int(match.group(1)), match.group(2)
