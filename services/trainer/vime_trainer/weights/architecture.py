"""The shape and features of a Hugging Face decoder checkpoint, as the Megatron side needs them.

Read from ``config.json`` alone (no transformers import): the three supported families differ only
in a few switches — Qwen3 has per-head QK RMSNorm and no biases, Qwen2 has q/k/v biases, Llama
has neither, and small Qwen2/Llama models tie the output layer to the embeddings. Anything else
(sliding windows, MLP or output-projection biases, unknown RoPE scalings) is refused with a clear
message rather than converted wrongly.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

Family = Literal["qwen3", "qwen2", "llama"]

ARCHITECTURES: dict[str, Family] = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}


class UnsupportedModel(ValueError):
    """The checkpoint uses a feature this converter does not map."""


@dataclass(frozen=True)
class Architecture:
    """What Megatron must build to hold an HF checkpoint's weights exactly."""

    family: Family
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    rope_scaling_factor: float | None = None
    torch_dtype: str = "float32"

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Architecture:
        """Build from a parsed ``config.json``; raises `UnsupportedModel` for what cannot be mapped."""
        archs = config.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            raise UnsupportedModel(
                f"architectures={archs} is not supported: expected one of {sorted(ARCHITECTURES)}"
            )
        _refuse_unsupported(family, config)
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            family=family,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            rope_theta=float(_rope(config).get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_layernorm=family == "qwen3",
            rope_scaling_factor=_llama3_factor(_rope(config)),
            torch_dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> Architecture:
        """Read ``<path>/config.json``."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist: is {path} a Hugging Face checkpoint directory?")
        return cls.from_hf_config(json.loads(file.read_text()))

    def check_parallel(self, tp: int, pp: int) -> None:
        """Refuse a TP/PP layout this model cannot be split into, saying why."""
        if self.num_query_groups % tp:
            raise UnsupportedModel(
                f"tensor_model_parallel_size={tp} does not divide the {self.num_query_groups} KV heads"
            )
        if self.num_attention_heads % tp or self.vocab_size % tp or self.ffn_hidden_size % tp:
            raise UnsupportedModel(
                f"tensor_model_parallel_size={tp} must divide the attention heads "
                f"({self.num_attention_heads}), the vocabulary ({self.vocab_size}) and the MLP width "
                f"({self.ffn_hidden_size})"
            )
        if self.num_layers % pp:
            raise UnsupportedModel(
                f"pipeline_model_parallel_size={pp} does not divide the {self.num_layers} layers"
            )


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return dict(rope)


def _llama3_factor(rope: dict[str, Any]) -> float | None:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    # Megatron's rope_scaling hard-codes Llama 3.1's low/high frequency factors and 8192 window.
    expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if kind == "llama3" and all(float(rope.get(k, v)) == v for k, v in expected.items()):
        return float(rope.get("factor", 8.0))
    raise UnsupportedModel(f"RoPE scaling {rope} is not supported (only default and Llama 3.1's llama3)")


def _refuse_unsupported(family: Family, config: dict[str, Any]) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act={config.get('hidden_act')!r}: only silu (SwiGLU) is supported")
    if config.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias=true is not supported")
    if family != "qwen2" and config.get("attention_bias"):
        raise UnsupportedModel(f"{family} with attention_bias=true (biased o_proj) is not supported")
    if config.get("use_sliding_window") and config.get("sliding_window"):
        raise UnsupportedModel("sliding-window attention is not supported")
    if config.get("num_experts") or config.get("num_local_experts"):
        raise UnsupportedModel("mixture-of-experts models are not supported")
