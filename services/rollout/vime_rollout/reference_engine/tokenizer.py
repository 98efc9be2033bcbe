"""The model's tokenizer, for the two things the engine needs it for: stop strings and its EOS id."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .sequence import Decoder

log = logging.getLogger("vime.reference_engine")


@dataclass(frozen=True)
class TokenizerInfo:
    decode: Decoder | None
    """``decode(token_ids, skip_special_tokens)``; None without a tokenizer (stop strings refused)."""
    eos_id: int | None
    """The tokenizer's EOS id: vLLM stops on it (with the config's) unless ignore_eos."""


def load_tokenizer(model_dir: Path) -> TokenizerInfo:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer in %s (%s): stop strings will be refused", model_dir, exc)
        return TokenizerInfo(None, None)

    def decode(token_ids: list[int], skip_special_tokens: bool) -> str:
        return str(tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    eos = getattr(tok, "eos_token_id", None)
    return TokenizerInfo(decode, eos if isinstance(eos, int) else None)
