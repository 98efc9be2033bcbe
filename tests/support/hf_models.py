"""Small random Qwen2 / Llama checkpoints built with transformers (Qwen3 comes from the tiny-model kit),
for the trainer's HF mapping tests and the Megatron loading tests."""

from __future__ import annotations

from pathlib import Path

import torch


def build_hf(out: Path, family: str, tie: bool, seed: int = 0) -> Path:
    """Save a 2-layer random ``family`` model (qwen2 or llama) in HF format under ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )
    if family == "qwen2":
        config, cls = (
            Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
            Qwen2ForCausalLM,
        )
    else:
        config, cls = (
            LlamaConfig(**common, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
            LlamaForCausalLM,
        )
    config.architectures = [cls.__name__]
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # non-trivial norms and biases, so their mapping is really exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(out))
    return out
