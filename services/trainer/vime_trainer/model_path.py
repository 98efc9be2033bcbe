"""The HF checkpoint the trainer ranks load: the same directory the engines serve.

``model.hf_checkpoint`` when set; otherwise the tiny-model kit's checkpoint under
``$VIME_MODEL_CACHE`` (else ``<output_dir>/models``), built on first use. The rollout manager
resolves it the same way, so with a shared cache both sides load identical weights and the first
push (version 1) republishes what the engines started from.
"""

from __future__ import annotations

import os
from pathlib import Path

from vime.config import RunConfig


def resolve_hf_checkpoint(cfg: RunConfig) -> Path:
    if cfg.model.hf_checkpoint:
        path = Path(cfg.model.hf_checkpoint)
        if not path.exists():
            raise FileNotFoundError(f"model.hf_checkpoint {path} does not exist")
        return path
    from vime.models.tiny import ensure_tiny_qwen3

    cache = Path(os.environ.get("VIME_MODEL_CACHE") or Path(cfg.output_dir) / "models")
    return ensure_tiny_qwen3(cache, cfg.model.tiny_model_size).resolve()
