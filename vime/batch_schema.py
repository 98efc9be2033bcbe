"""Column schema of rollout batches: names and dtypes, sample-status codes, and the consistency
checks shared by the in-memory batch and the blob decoder (a bad blob and a bad build fail alike)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from vime.types import SampleStatus

STATUS_CODES: tuple[SampleStatus, ...] = tuple(SampleStatus)
"""``statuses[i]`` is the index of the sample's status in this tuple."""

# Column name -> dtype, by what one entry describes.
TOKEN_COLUMNS: dict[str, np.dtype[Any]] = {"tokens": np.dtype(np.int32)}
RESPONSE_COLUMNS: dict[str, np.dtype[Any]] = {
    "loss_masks": np.dtype(np.uint8),
    "rollout_log_probs": np.dtype(np.float32),
}
SAMPLE_COLUMNS: dict[str, np.dtype[Any]] = {
    "response_lengths": np.dtype(np.int32),
    "rewards": np.dtype(np.float32),
    "advantages": np.dtype(np.float32),
    "has_rollout_log_probs": np.dtype(np.bool_),
    "sample_indices": np.dtype(np.int64),
    "group_indices": np.dtype(np.int64),
    "weight_versions": np.dtype(np.int32),
    "first_weight_versions": np.dtype(np.int32),
    "statuses": np.dtype(np.uint8),
    "truncated": np.dtype(np.bool_),
}
COLUMNS: dict[str, np.dtype[Any]] = {
    **TOKEN_COLUMNS,
    "token_offsets": np.dtype(np.int64),
    **RESPONSE_COLUMNS,
    **SAMPLE_COLUMNS,
}


class BatchFormatError(ValueError):
    """A batch (or its encoded blob) is not what the format promises; the message says which part."""


def gather_ragged(
    values: npt.NDArray[Any], offsets: npt.NDArray[np.int64], rows: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
    """Concatenate ``values[offsets[r]:offsets[r+1]]`` for r in ``rows`` without a Python loop."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    new_off = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_off[1:])
    idx = np.repeat(starts - new_off[:-1], lengths) + np.arange(new_off[-1], dtype=np.int64)
    return values[idx], new_off


def check_columns(c: Any) -> None:
    """Dtypes, 1-D shapes, lengths and offsets agree; raise `BatchFormatError` naming what doesn't."""
    for name, dtype in COLUMNS.items():
        arr = getattr(c, name)
        if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.ndim != 1:
            got = f"{arr.dtype}{list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise BatchFormatError(f"column {name!r}: expected a 1-D {dtype} array, got {got}")
    n = len(c.response_lengths)
    for name in SAMPLE_COLUMNS:
        if len(getattr(c, name)) != n:
            raise BatchFormatError(f"column {name!r} has {len(getattr(c, name))} entries for {n} samples")
    off = c.token_offsets
    if len(off) != n + 1 or off[0] != 0 or off[-1] != len(c.tokens) or np.any(np.diff(off) < 0):
        raise BatchFormatError(
            f"token_offsets inconsistent: {len(off)} entries for {n} samples and {len(c.tokens)} tokens "
            "(must start at 0, never decrease, end at the token count)"
        )
    if np.any(c.response_lengths < 0) or np.any(c.response_lengths > np.diff(off)):
        raise BatchFormatError("response_lengths must lie between 0 and each sample's token count")
    n_resp = int(c.response_lengths.sum(dtype=np.int64))
    for name in RESPONSE_COLUMNS:
        if len(getattr(c, name)) != n_resp:
            raise BatchFormatError(
                f"column {name!r} has {len(getattr(c, name))} entries for {n_resp} response tokens"
            )
    if n and int(c.statuses.max()) >= len(STATUS_CODES):
        raise BatchFormatError(f"statuses hold an unknown code {int(c.statuses.max())}")


def check_schedule(rb: Any) -> None:
    """The rank lies within the DP size, micro-batches tile the rows, step counts add up to them."""
    if not 0 <= rb.dp_rank < rb.dp_size:
        raise BatchFormatError(f"dp_rank {rb.dp_rank} outside 0..{rb.dp_size - 1}")
    expected_start = 0
    for start, end in rb.micro_batches:
        if start != expected_start or end <= start:
            raise BatchFormatError(f"micro_batches {rb.micro_batches} are not consecutive non-empty ranges")
        expected_start = end
    if expected_start != rb.num_samples:
        raise BatchFormatError(f"micro_batches cover {expected_start} rows of {rb.num_samples}")
    if sum(rb.num_microbatches) != len(rb.micro_batches) or min(rb.num_microbatches, default=0) < 0:
        raise BatchFormatError(
            f"num_microbatches {rb.num_microbatches} do not add up to {len(rb.micro_batches)} micro-batches"
        )
