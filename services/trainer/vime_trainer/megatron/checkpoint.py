"""Distributed checkpoints (Megatron ``dist_checkpointing``) plus the run state the controller needs.

Layout: ``<checkpoint_dir>/rollout_<id:07d>/`` holds the sharded model and optimizer state and,
written last by global rank 0, ``vime_state.json`` (rollout id, the next rollout id to run, the
parallel layout, the architecture and source HF checkpoint, and whatever run state the controller
passed in: data-source position, weight version...). A directory without that file is an interrupted save and is ignored, so resuming
always picks the newest *complete* checkpoint. ``dist_checkpointing`` reshards on load, so a
checkpoint saved at TP=2 loads at TP=1 (the HF export does that).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

STATE_FILE = "vime_state.json"
FORMAT = 1
_DIR = re.compile(r"^rollout_(\d+)$")


def checkpoint_path(root: str | Path, rollout_id: int) -> Path:
    return Path(root) / f"rollout_{rollout_id:07d}"


def latest_checkpoint(root: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint under ``root`` and its state, or None."""
    base = Path(root)
    if not base.is_dir():
        return None
    found = []
    for d in base.iterdir():
        m = _DIR.match(d.name)
        if m and (d / STATE_FILE).is_file():
            found.append((int(m.group(1)), d))
    for _, d in sorted(found, reverse=True):
        try:
            return d, json.loads((d / STATE_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            continue  # unreadable state: fall back to the previous checkpoint
    return None


def _sharded(model: Any, optimizer: Any | None, loading: bool) -> dict[str, Any]:
    model_sd = model.sharded_state_dict()
    out = {"model": model_sd}
    if optimizer is not None:
        out["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=loading)
    return out


def save_checkpoint(
    root: str | Path,
    rollout_id: int,
    model: Any,
    optimizer: Any,
    run_state: dict[str, Any],
    meta: dict[str, Any],
) -> Path:
    """Save model + optimizer of every rank (collective); rank 0 then marks the checkpoint complete."""
    from megatron.core import dist_checkpointing

    path = checkpoint_path(root, rollout_id)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / STATE_FILE).unlink(missing_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(model, optimizer, loading=False), str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        state = {
            "format": FORMAT,
            "rollout_id": rollout_id,
            "next_rollout_id": rollout_id + 1,
            **meta,
            "saved_at": time.time(),
            "run_state": run_state,
        }
        tmp = path / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path / STATE_FILE)
    dist.barrier()
    return path


def load_checkpoint(path: str | Path, model: Any, optimizer: Any | None) -> dict[str, Any]:
    """Load model (+ optimizer) state from ``path`` into this rank's shard; returns the saved state."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded(model, optimizer, loading=True), str(path))
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not fit the model: missing {missing}, unexpected {unexpected}"
        )
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    state_file = Path(path) / STATE_FILE
    return json.loads(state_file.read_text()) if state_file.is_file() else {}
