"""Distributed checkpoints (Megatron ``dist_checkpointing``) plus the run state the controller needs.

Layout: ``<checkpoint_dir>/rollout_<id:07d>/`` holds the sharded model and optimizer state and,
written last by global rank 0, ``vime_state.json`` (rollout id, the next rollout id to run, the
parallel layout, the architecture and source HF checkpoint, and whatever run state the controller
passed in: data-source position, weight version...). A directory without that file is an
interrupted save or one still being written, and is ignored, so resuming always picks the newest
*complete* checkpoint; the shard files may be written in the background (`PendingCheckpoint`).
``dist_checkpointing`` reshards on load, so a checkpoint saved at TP=2 loads at TP=1 (the HF
export does that).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch
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


class PendingCheckpoint:
    """A checkpoint whose shard files this rank writes, in a thread when ``background``.

    A background save returns once the state is copied off the model (GPU → host, or a copy of a
    CPU rank's tensors): the next step may change the model at once. Otherwise the files are
    written before it returns, as Megatron's synchronous save does. `finish` (collective) waits
    for every rank's files and completes it: Megatron's metadata, then rank 0's
    ``vime_state.json``. Until then the directory is an incomplete checkpoint, which a resume skips.
    """

    def __init__(
        self, path: Path, request: Any, state: dict[str, Any], device: str, background: bool
    ) -> None:
        self.path, self.request, self.state, self.device = path, request, state, device
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        args = list(request.async_fn_args)
        if request.preload_fn is not None:
            args[1] = request.preload_fn()
            if background:
                args[1] = _owned(request.async_fn_args[1], args[1])
        if not background:
            self._write(args)
            return
        self.thread = threading.Thread(
            target=self._write, args=(args,), name=f"vime-save-{path.name}", daemon=True
        )
        self.thread.start()

    def _write(self, args: list[Any]) -> None:
        try:
            if self.request.async_fn is not None:  # None: nothing of this rank's to write
                self.request.async_fn(*args, **self.request.async_fn_kwargs)
        except BaseException as exc:  # raised on every rank by `finish`
            self.error = exc

    def finish(self) -> None:
        """Collective: once every rank has written its files, complete the checkpoint; raises on
        every rank when one failed."""
        if self.thread is not None:
            self.thread.join()
        flag = torch.tensor([int(self.error is not None)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            mine = f": {type(self.error).__name__}: {self.error}" if self.error is not None else ""
            raise RuntimeError(f"writing checkpoint {self.path} failed on a rank{mine}") from self.error
        for fn in self.request.finalize_fns:  # Megatron's metadata (collective)
            fn()
        if dist.get_rank() == 0:
            tmp = self.path / (STATE_FILE + ".tmp")
            tmp.write_text(json.dumps({**self.state, "saved_at": time.time()}, indent=1))
            os.replace(tmp, self.path / STATE_FILE)
        dist.barrier()


def _owned(staged: list[Any], preloaded: list[Any]) -> list[Any]:
    """The write buckets with every tensor the rank's own copy: Megatron's preload copies GPU
    tensors to the host but passes a CPU rank's tensors through, and the next step changes those."""
    out = []
    for (file_name, key, (data, tensors)), (_, _, (_, loaded)) in zip(staged, preloaded, strict=True):
        owned = [
            (item, t.clone() if t is src else t) for (item, src), (_, t) in zip(tensors, loaded, strict=True)
        ]
        out.append((file_name, key, (data, owned)))
    return out


def start_checkpoint(
    root: str | Path,
    rollout_id: int,
    model: Any,
    optimizer: Any,
    run_state: dict[str, Any],
    meta: dict[str, Any],
    device: str,
    background: bool,
) -> PendingCheckpoint:
    """Save model + optimizer of every rank (collective), to be completed by `PendingCheckpoint.finish`."""
    from megatron.core import dist_checkpointing

    path = checkpoint_path(root, rollout_id)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / STATE_FILE).unlink(missing_ok=True)
    dist.barrier()
    request = dist_checkpointing.save(
        _sharded(model, optimizer, loading=False), str(path), async_sharded_save=True
    )
    state = {
        "format": FORMAT,
        "rollout_id": rollout_id,
        "next_rollout_id": rollout_id + 1,
        **meta,
        "run_state": run_state,
    }
    return PendingCheckpoint(path, request, state, device, background)


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
