"""The direct weight load (``engine.weight_load: direct``): the trainer ↔ worker-extension wire and
the checksum both sides compute.

The engine runs the worker extension `EXTENSION` (vLLM: ``--worker-extension-cls``; the reference
engine takes the same flag) and answers ``POST /collective_rpc {"method": ..., "args": [str]}``:

- ``vime_direct_layout()`` → ``{"params": [...], "refusal": str | None}``: every parameter (name,
  the HF tensors it is made of in storage order, dtype, bytes, whether it can be written in place)
  and, when the engine as a whole cannot be loaded directly (quantised, tensor/pipeline parallel),
  why;
- ``vime_direct_open(encode_open(...))``: the trainer's staging buffers, opened once per trainer
  session and engine start (CUDA IPC handles, or shared-memory files), and each parameter's view
  recorded;
- ``vime_direct_load(encode_load(...))`` → ``{"bytes": n, "checksum": "<int>"}``: copy each
  ``[name, offset, nbytes]`` of one buffer into its parameter, then checksum what the parameters
  now hold;
- ``vime_direct_close()``: drop the buffers.

`checksum` is computed by the trainer over the bytes it packed and by the engine over its
parameters after the copy, with the same integer arithmetic, so the two agree exactly when every
byte landed where it should. Per parameter it sums ``SEGMENTS`` equal slices as int32 words
(mod 2³²: no temporaries, order-independent, one kernel per parameter); the sums are combined
with their positions, so a part written to the wrong place changes the result. torch is imported
lazily: the core package does not depend on it.
"""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

EXTENSION = "vime_rollout.vllm_ext.direct_load.DirectLoadExtension"
"""``--worker-extension-cls`` of engines started with ``engine.weight_load: direct``."""

LAYOUT, OPEN, LOAD, CLOSE = "vime_direct_layout", "vime_direct_open", "vime_direct_load", "vime_direct_close"

ALIGN = 256
"""Byte alignment of each parameter in a staging buffer (any dtype, and int32 words, can view it)."""
SEGMENTS = 16
_MOD = (1 << 61) - 1


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to `ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def encode_open(session: str, buffers: Sequence[dict[str, Any]]) -> str:
    """The ``vime_direct_open`` argument. A buffer is ``{"nbytes": n, "cuda_ipc": {gpu_uuid:
    rebuild_cuda_tensor args}}`` or ``{"nbytes": n, "shm": path}``; pickled (IPC handles hold bytes)."""
    return base64.b64encode(pickle.dumps({"session": session, "buffers": list(buffers)})).decode("ascii")


def decode_open(text: str) -> dict[str, Any]:
    data = pickle.loads(base64.b64decode(text))
    if not isinstance(data, dict) or "session" not in data or "buffers" not in data:
        raise ValueError("vime_direct_open needs {session, buffers}")
    return data


def encode_load(session: str, slot: int, bucket: int, params: Sequence[Sequence[Any]]) -> str:
    """The ``vime_direct_load`` argument: buffer ``slot`` holds bucket ``bucket``, ``[name, offset, nbytes]`` each."""
    return json.dumps(
        {"session": session, "slot": slot, "bucket": bucket, "params": [list(p) for p in params]}
    )


def decode_load(text: str) -> dict[str, Any]:
    data = json.loads(text)
    if not isinstance(data, dict) or not {"session", "slot", "bucket", "params"} <= set(data):
        raise ValueError("vime_direct_load needs {session, slot, bucket, params}")
    return dict(data)


def _words(region: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``region`` (uint8, 1-D) as int32 words and the number of equal segments to sum them in."""
    import torch

    n = region.numel()
    if n % 4:
        return region.to(torch.int32), 1  # odd sizes: per-byte words (small tensors only)
    if region.data_ptr() % 4:
        region = region.clone()  # same words, aligned storage: both sides compute the same value
    words = region.view(torch.int32)
    segments = next(s for s in (SEGMENTS, 4, 2, 1) if (n // 4) % s == 0)
    return words, segments


def checksum(regions: Sequence[torch.Tensor]) -> int:
    """One integer for the bytes of ``regions`` (uint8 1-D tensors, one per parameter, in order)."""
    import torch

    if not regions:
        return 0
    sums = torch.zeros((len(regions), SEGMENTS), dtype=torch.int32, device=regions[0].device)
    for i, region in enumerate(regions):
        words, segments = _words(region)
        torch.sum(words.view(segments, -1), dim=1, dtype=torch.int32, out=sums[i, :segments])
    values = sums.cpu().view(-1).tolist()
    return sum((k + 1) * (v & 0xFFFFFFFF) for k, v in enumerate(values)) % _MOD
