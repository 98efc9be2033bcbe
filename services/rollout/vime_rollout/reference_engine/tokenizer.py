"""Detokenisation for stop strings (the only place the engine needs text)."""

from __future__ import annotations

import logging
from pathlib import Path

from .sequence import Decoder

log = logging.getLogger("vime.reference_engine")


def load_decoder(model_dir: Path) -> Decoder | None:
    """``decode(token_ids, skip_special_tokens)`` from the model's tokenizer, or None without one."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer in %s (%s): stop strings will be refused", model_dir, exc)
        return None

    def decode(token_ids: list[int], skip_special_tokens: bool) -> str:
        return str(tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    return decode
