"""Where the policy model lives: one rule for the trainer, the rollout manager and the CLI.

``model.hf_checkpoint`` when set; otherwise the tiny-model kit's checkpoint under
``$VIME_MODEL_CACHE`` (else ``<output_dir>/models``), built on first use. Every service resolving
it the same way is what makes the trainer's ranks and the engines start from identical weights,
so the first push (version 1) republishes what the engines already serve.
"""

from __future__ import annotations

import os
from pathlib import Path

from vime.config import RunConfig

MODEL_CACHE_ENV = "VIME_MODEL_CACHE"


def model_cache_dir(cfg: RunConfig) -> Path:
    """Where the tiny kit's checkpoints are built: ``$VIME_MODEL_CACHE``, else ``<output_dir>/models``."""
    return Path(os.environ.get(MODEL_CACHE_ENV) or Path(cfg.output_dir) / "models")


def policy_model_path(cfg: RunConfig) -> Path:
    """The HF checkpoint directory of the policy (the kit model is built here on first use)."""
    if cfg.model.hf_checkpoint:
        path = Path(cfg.model.hf_checkpoint)
        if not path.exists():
            raise FileNotFoundError(f"model.hf_checkpoint {path} does not exist")
        return path
    from vime.models.tiny import ensure_tiny_qwen3

    return ensure_tiny_qwen3(model_cache_dir(cfg), cfg.model.tiny_model_size).resolve()
