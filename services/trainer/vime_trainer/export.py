"""Export a training checkpoint as a Hugging Face checkpoint.

    python -m vime_trainer.export --checkpoint CKPT_DIR/rollout_0000012 --out OUT_DIR [--hf-base HF_DIR]
    python -m vime_trainer.export --checkpoint CKPT_DIR --out OUT_DIR     # the newest complete one

Runs as one process (TP=1, PP=1): ``dist_checkpointing`` reshards whatever layout the run saved
with. The architecture and the source HF checkpoint are read from the checkpoint's
``vime_state.json``; config, tokenizer and generation files are copied from the source (or from
``--hf-base``), and weights are written in the source's dtype unless ``--dtype`` says otherwise.
On a machine without a GPU this installs the CPU shim, so run it as its own process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from vime import procs
from vime.config import TrainerConfig
from vime_trainer.megatron.checkpoint import STATE_FILE, latest_checkpoint
from vime_trainer.weights.architecture import Architecture


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint directory itself, or the newest complete one under a checkpoint root."""
    p = Path(path)
    if (p / STATE_FILE).is_file():
        return p
    found = latest_checkpoint(p)
    if found is None:
        raise FileNotFoundError(f"{p} is neither a complete checkpoint nor a directory holding one")
    return found[0]


def export_checkpoint(
    checkpoint: str, out_dir: str, hf_base: str | None = None, dtype: str | None = None
) -> Path:
    """Load ``checkpoint`` at TP=1 and write it to ``out_dir`` in HF format; returns ``out_dir``."""
    import json

    from vime_trainer.megatron.checkpoint import load_checkpoint
    from vime_trainer.megatron.gather import iter_hf_tensors
    from vime_trainer.megatron.model import build_model
    from vime_trainer.megatron.runtime import init_rank, shutdown_rank
    from vime_trainer.weights.hf_checkpoint import save_hf_checkpoint

    path = resolve_checkpoint(checkpoint)
    state: dict[str, Any] = json.loads((path / STATE_FILE).read_text())
    arch = Architecture(**state["architecture"])
    base = hf_base or state.get("hf_checkpoint")
    if base is None or not Path(base).is_dir():
        raise FileNotFoundError(f"the source HF checkpoint {base!r} is not available: pass --hf-base")
    info = init_rank(0, 1, "127.0.0.1", procs.free_port(), tp=1, pp=1, seed=0)
    try:
        trainer = TrainerConfig(bf16=state.get("params_dtype") == "bfloat16")
        model = build_model(arch, trainer, info)
        load_checkpoint(path, model, optimizer=None)
        local = {n: p.detach() for n, p in model.named_parameters()}
        out_dtype = getattr(torch, dtype or arch.torch_dtype)
        return save_hf_checkpoint(
            iter_hf_tensors(arch, local, info, 0), out_dir, base_dir=base, dtype=out_dtype
        )
    finally:
        shutdown_rank()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vime_trainer.export", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--checkpoint", required=True, help="a rollout_* checkpoint directory or the checkpoint root"
    )
    parser.add_argument("--out", required=True, help="directory to write the HF checkpoint to")
    parser.add_argument("--hf-base", default=None, help="HF checkpoint to copy config/tokenizer from")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, args.hf_base, args.dtype)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
