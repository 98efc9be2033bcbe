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

QWEN3_SHAPES: dict[str, TinyShape] = {
    # Real Qwen3 shapes (vocabulary 151936) with random weights, for GPU tests and benchmarks where
    # the size is the point: build them with ``fill_vocab=True`` so every token id decodes.
    "qwen3-0.6b": TinyShape(1024, 28, 16, 8, 128, 3072, 151936, 40960),
    "qwen3-1.7b": TinyShape(2048, 28, 16, 8, 128, 6144, 151936, 40960),
    "qwen3-4b": TinyShape(2560, 36, 32, 8, 128, 9728, 151936, 40960),
}


def shape_named(name: str) -> TinyShape:
    """A kit size (``nano``, ``micro``, ``small``) or a Qwen3 shape (``qwen3-0.6b``, ...)."""
    shape = SHAPES.get(name) or QWEN3_SHAPES.get(name)
    if shape is None:
        raise KeyError(f"unknown model shape {name!r}: choose one of {sorted(SHAPES) + sorted(QWEN3_SHAPES)}")
    return shape


def vocabulary(filled_to: int | None = None) -> list[str]:
    """Token strings in id order: the specials, then printable ASCII and newline, then (with
    ``filled_to``) filler tokens ``<|filler_N|>`` up to that many ids."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    kit = [*SPECIALS, *chars]
    return kit + [filler_token(i) for i in range(len(kit), filled_to or 0)]


def filler_token(token_id: int) -> str:
    """The string of filler id ``token_id``. Text never encodes to one (the pre-tokenizer splits
    every character); they exist so that a model with a real vocabulary size samples only ids
    its tokenizer can decode (real vLLM detokenises every sampled id)."""
    return f"<|filler_{token_id}|>"


def build_tokenizer(out_dir: str | Path, vocab_size: int = 128, *, fill: bool = False) -> Any:
    """Build and save the character tokenizer; returns the transformers fast tokenizer.

    ``fill`` gives every id below ``vocab_size`` a token (filler tokens after the kit's own).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary(vocab_size if fill else None)
    if vocab_size < len(vocabulary()):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(vocabulary())} kit tokens")
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
    fill_vocab: bool = False,
    logit_scale: float = 1.0,
    device: str = "cpu",
    weights: bool = True,
) -> Path:
    """Build a random-init Qwen3 checkpoint with the kit tokenizer in ``out_dir``; returns the path.

    ``size`` is a kit size or a Qwen3 shape name (`shape_named`). ``fill_vocab`` fills the
    tokenizer to the model's vocabulary (`filler_token`). ``logit_scale`` multiplies the output
    layer, so the next-token distributions are peaked rather than near-uniform: greedy choices
    have no near-ties in bf16 and log-prob comparisons mean something. ``device="cuda"`` builds
    the weights on the GPU (seconds instead of minutes for billions of parameters).
    ``weights=False`` writes only the config and tokenizer (for vLLM's ``--load-format dummy``).
    """
    from transformers import GenerationConfig

    shape = shape or shape_named(size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, shape.vocab_size, fill=fill_vocab)
    eos_id = vocabulary().index(EOS)
    config = _qwen3_config(shape, dtype, eos_id)
    if weights:
        _save_random_weights(config, out, seed=seed, dtype=dtype, logit_scale=logit_scale, device=device)
    else:
        config.save_pretrained(str(out))
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(str(out))
    kit = {"size": size, "seed": seed, "dtype": dtype, "fill_vocab": fill_vocab, "logit_scale": logit_scale}
    (out / "vime_kit.json").write_text(json.dumps({**kit, "weights": weights, **asdict(shape)}))
    return out


def _qwen3_config(shape: TinyShape, dtype: str, eos_id: int) -> Any:
    from transformers import Qwen3Config

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
    return config


def _save_random_weights(
    config: Any, out: Path, *, seed: int, dtype: str, logit_scale: float, device: str
) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(str(out), safe_serialization=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


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
