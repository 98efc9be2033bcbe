"""The policy model as the rollout manager needs it: a local path every engine loads, and its tokenizer.

With ``model.hf_checkpoint`` unset the tiny-model kit builds a random-init Qwen3 locally (nothing
downloaded) under ``$VIME_MODEL_CACHE`` or ``<output_dir>/models``; the manager builds it once
and hands the same path to every engine it starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vime.config import RunConfig


def resolve_model_path(cfg: RunConfig) -> Path:
    """The checkpoint directory engines load (built on first use for the tiny kit)."""
    if cfg.model.hf_checkpoint:
        path = Path(cfg.model.hf_checkpoint)
        if not path.exists():
            raise FileNotFoundError(f"model.hf_checkpoint {path} does not exist")
        return path
    from vime.models.tiny import ensure_tiny_qwen3

    cache = Path(os.environ.get("VIME_MODEL_CACHE") or Path(cfg.output_dir) / "models")
    return ensure_tiny_qwen3(cache, cfg.model.tiny_model_size).resolve()


def served_model_name(cfg: RunConfig, model_path: Path) -> str:
    """The ``model`` field of generate requests: the served name, else the path (as the seed sends)."""
    return cfg.model.served_model_name or str(model_path)


def load_tokenizer(model_path: Path) -> Any:
    """The checkpoint's tokenizer (transformers; no torch needed)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))
