"""The policy model as the rollout manager needs it: the name generate requests carry, and its tokenizer.

The checkpoint every engine loads is `vime.models.policy_model_path` (the tiny kit's, built once
under ``$VIME_MODEL_CACHE`` or ``<output_dir>/models``, when ``model.hf_checkpoint`` is unset);
the manager resolves it once and hands the same path to every engine it starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vime.config import RunConfig


def served_model_name(cfg: RunConfig, model_path: Path) -> str:
    """The ``model`` field of generate requests: the served name, else the path (as the seed sends)."""
    return cfg.model.served_model_name or str(model_path)


def load_tokenizer(model_path: Path) -> Any:
    """The checkpoint's tokenizer (transformers; no torch needed)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))
