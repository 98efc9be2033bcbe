"""The tiny-model kit: a small Qwen3-architecture checkpoint and a character tokenizer, built here.

Nothing is downloaded from a model hub. The tokenizer is character level (every printable ASCII
character is a token, plus Qwen's chat specials), so arithmetic prompts and answers tokenise
one digit per token, which a model of a few million parameters can learn on a CPU. The
checkpoint is saved in Hugging Face format (config.json with ``architectures``, safetensors,
tokenizer files, generation_config.json) so that transformers, Megatron's loader and real vLLM all
read it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIALS = (EOS, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    """Qwen3 shape parameters of a kit model."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = 128
    max_position_embeddings: int = 8192


SHAPES: dict[str, TinyShape] = {
    # ~0.1M parameters: unit tests of conversion and sharding.
    "nano": TinyShape(64, 2, 4, 2, 16, 192),
    # ~0.8M parameters: the CPU demo and integration tests.
    "micro": TinyShape(128, 4, 4, 2, 32, 384),
    # ~25M parameters: CPU benchmarks.
    "small": TinyShape(512, 8, 8, 4, 64, 1536),
}


def vocabulary() -> list[str]:
    """Token strings in id order: the specials, then printable ASCII and newline."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    return [*SPECIALS, *chars]


def build_tokenizer(out_dir: str | Path, vocab_size: int = 128) -> Any:
    """Build and save the character tokenizer; returns the transformers fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary()
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(vocab)} kit tokens")
    ids = {tok: i for i, tok in enumerate(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token=" ", model_max_length=8192
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_qwen3(
    out_dir: str | Path,
    size: str = "micro",
    *,
    seed: int = 0,
    dtype: str = "float32",
    shape: TinyShape | None = None,
) -> Path:
    """Build a random-init Qwen3 checkpoint with the kit tokenizer in ``out_dir``; returns the path."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    shape = shape or SHAPES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, shape.vocab_size)
    eos_id = vocabulary().index(EOS)
    config = Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype=dtype,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(str(out))
    (out / "vime_kit.json").write_text(
        json.dumps({"size": size, "seed": seed, "dtype": dtype, **asdict(shape)})
    )
    return out


def ensure_tiny_qwen3(cache_dir: str | Path, size: str = "micro", *, seed: int = 0) -> Path:
    """The kit model of ``size``/``seed`` under ``cache_dir``, built on first use."""
    out = Path(cache_dir) / f"tiny-qwen3-{size}-s{seed}"
    if not (out / "vime_kit.json").exists():
        build_tiny_qwen3(out, size, seed=seed)
    return out


def num_parameters(shape: TinyShape) -> int:
    """Parameter count of a kit shape (untied embeddings, QK-norm, no biases)."""
    h, kv, hd = shape.hidden_size, shape.num_key_value_heads, shape.head_dim
    q = shape.num_attention_heads * hd
    attn = h * q + 2 * h * kv * hd + q * h + 2 * hd
    mlp = 3 * h * shape.intermediate_size
    layer = attn + mlp + 2 * h
    return shape.num_hidden_layers * layer + 2 * shape.vocab_size * h + h
