"""HF ↔ Megatron weight conversion and TP sharding: pure tensor code, checked bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vime_trainer.weights.architecture import Architecture, UnsupportedModel
from vime_trainer.weights.hf_checkpoint import HFReader
from vime_trainer.weights.hf_mapping import (
    hf_names,
    hf_to_mcore_state,
    local_to_global,
    mcore_names,
    mcore_to_hf_state,
    to_hf,
)
from vime_trainer.weights.tp_layout import shard, split_dim, unshard

FAMILIES = ["qwen3", "qwen2_tied", "llama", "llama_tied"]


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_megatron_hf_round_trip_is_bit_exact(hf_checkpoints: dict[str, Path], name: str) -> None:
    arch = Architecture.from_checkpoint(hf_checkpoints[name])
    hf = HFReader(hf_checkpoints[name]).state_dict()
    assert set(hf_names(arch)) == set(hf)  # every stored tensor is mapped, nothing invented
    back = mcore_to_hf_state(arch, hf_to_mcore_state(arch, hf.__getitem__))
    assert back.keys() == hf.keys()
    for key, value in hf.items():
        assert torch.equal(back[key], value), key


def test_family_switches_are_read_from_config(hf_checkpoints: dict[str, Path]) -> None:
    qwen3 = Architecture.from_checkpoint(hf_checkpoints["qwen3"])
    qwen2 = Architecture.from_checkpoint(hf_checkpoints["qwen2_tied"])
    llama = Architecture.from_checkpoint(hf_checkpoints["llama"])
    assert (qwen3.qk_layernorm, qwen3.qkv_bias, qwen3.tie_word_embeddings) == (True, False, False)
    assert (qwen2.qk_layernorm, qwen2.qkv_bias, qwen2.tie_word_embeddings) == (False, True, True)
    assert (llama.qk_layernorm, llama.qkv_bias, llama.tie_word_embeddings) == (False, False, False)
    assert "output_layer.weight" not in mcore_names(qwen2)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in mcore_names(qwen2)
    assert "decoder.layers.1.self_attention.q_layernorm.weight" in mcore_names(qwen3)


def test_qkv_is_laid_out_per_query_group(hf_checkpoints: dict[str, Path]) -> None:
    arch = Architecture.from_checkpoint(hf_checkpoints["qwen3"])  # 4 heads, 2 groups, head_dim 16
    hd, h = arch.head_dim, arch.hidden_size
    q = (
        torch.arange(arch.num_attention_heads, dtype=torch.float32)
        .repeat_interleave(hd)[:, None]
        .expand(-1, h)
    )
    k = 100 + torch.arange(2, dtype=torch.float32).repeat_interleave(hd)[:, None].expand(-1, h)
    v = 200 + torch.arange(2, dtype=torch.float32).repeat_interleave(hd)[:, None].expand(-1, h)
    sources = {
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
    }
    from vime_trainer.weights.hf_mapping import to_mcore

    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    qkv = to_mcore(arch, name, list(sources.values()))
    rows = qkv[::hd, 0].tolist()  # one value per head-sized block
    assert rows == [0, 1, 100, 200, 2, 3, 101, 201]  # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    assert [n for n, _ in to_hf(arch, name, qkv)] == list(sources)
    # TP=2 gives each rank whole groups
    assert shard(name, qkv, 1, 2)[::hd, 0].tolist() == [2, 3, 101, 201]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_reassemble_exactly(hf_checkpoints: dict[str, Path], name: str, tp: int) -> None:
    arch = Architecture.from_checkpoint(hf_checkpoints[name])
    full = hf_to_mcore_state(arch, HFReader(hf_checkpoints[name]).get)
    if arch.num_query_groups % tp:
        with pytest.raises(UnsupportedModel, match="KV heads"):
            arch.check_parallel(tp, 1)
        return
    for key, value in full.items():
        parts = [shard(key, value, r, tp) for r in range(tp)]
        if split_dim(key) is not None:
            assert all(p.shape[split_dim(key)] == value.shape[split_dim(key)] // tp for p in parts), key
        assert torch.equal(unshard(key, parts), value), key


def test_fc1_is_fused_per_rank() -> None:
    gate, up = torch.arange(8.0)[:, None], 100 + torch.arange(8.0)[:, None]
    fc1 = torch.cat([gate, up])
    rank1 = shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2)
    assert rank1[:, 0].tolist() == [
        4,
        5,
        6,
        7,
        104,
        105,
        106,
        107,
    ]  # [gate_1; up_1], not a slice of [gate; up]


def test_row_parallel_splits_columns_and_norms_replicate() -> None:
    w = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(shard("decoder.layers.3.mlp.linear_fc2.weight", w, 1, 2), w[:, 3:])
    norm = torch.arange(6.0)
    assert torch.equal(shard("decoder.final_layernorm.weight", norm, 1, 2), norm)


def test_local_layer_indices_become_global() -> None:
    assert (
        local_to_global("decoder.layers.1.mlp.linear_fc2.weight", 4)
        == "decoder.layers.5.mlp.linear_fc2.weight"
    )
    assert local_to_global("embedding.word_embeddings.weight", 4) == "embedding.word_embeddings.weight"


def test_tied_output_layer_loads_from_embeddings_and_is_not_exported(hf_checkpoints: dict[str, Path]) -> None:
    arch = Architecture.from_checkpoint(hf_checkpoints["qwen2_tied"])
    from vime_trainer.weights.hf_mapping import hf_sources

    assert hf_sources(arch, "output_layer.weight") == ["model.embed_tokens.weight"]
    assert to_hf(arch, "output_layer.weight", torch.zeros(2)) == []


BASE = {
    "architectures": ["Qwen3ForCausalLM"],
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 128,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "not supported"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"use_sliding_window": True, "sliding_window": 128}, "sliding-window"),
        ({"architectures": ["LlamaForCausalLM"], "attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unsupported_models_are_refused(change: dict, message: str) -> None:
    with pytest.raises(UnsupportedModel, match=message):
        Architecture.from_hf_config({**BASE, **change})


def test_llama3_rope_scaling_maps_to_megatron_factor() -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 5e5,
    }
    arch = Architecture.from_hf_config(
        {**BASE, "architectures": ["LlamaForCausalLM"], "rope_parameters": rope}
    )
    assert (arch.rope_scaling_factor, arch.rope_theta) == (32.0, 5e5)


def test_parallel_layout_checks_name_the_problem() -> None:
    arch = Architecture.from_hf_config(BASE)
    with pytest.raises(UnsupportedModel, match="layers"):
        arch.check_parallel(1, 3)
    arch.check_parallel(2, 2)
