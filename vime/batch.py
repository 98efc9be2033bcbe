"""The rollout batch: columnar arrays built from `Sample`s (seed step 30), split per DP rank in
training order (step 31), and the binary format a rank's share travels in through Redis.

Columns are flat numpy arrays plus offsets (ragged data), so a 256-sample batch is a dozen
buffers rather than hundreds of thousands of Python objects; the wire format is a msgspec
msgpack envelope whose arrays are raw buffers read back with `np.frombuffer`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import chain
from typing import Any, get_type_hints

import msgspec
import numpy as np
import numpy.typing as npt

from vime.algorithms import DPSchedule
from vime.batch_schema import (
    COLUMNS,
    RESPONSE_COLUMNS,
    SAMPLE_COLUMNS,
    STATUS_CODES,
    BatchFormatError,
    check_columns,
    check_schedule,
    gather_ragged,
)
from vime.types import Sample, SampleStatus

__all__ = [
    "BatchFormatError",
    "RankBatch",
    "RolloutBatch",
    "SampleColumns",
    "SampleRow",
    "decode_rank_batch",
    "encode_rank_batch",
    "split_by_dp",
]

FORMAT_MAGIC = "vime-rank-batch"
FORMAT_VERSION = 2
"""2: ``first_weight_versions`` (each sample's oldest weight version) added."""


@dataclass(frozen=True)
class SampleRow:
    """One sample read back out of a batch (views into the batch's arrays)."""

    tokens: npt.NDArray[np.int32]
    response_length: int
    loss_mask: npt.NDArray[np.uint8]
    rollout_log_probs: npt.NDArray[np.float32] | None
    reward: float
    advantage: float
    index: int
    group_index: int
    weight_version: int
    first_weight_version: int
    status: SampleStatus
    truncated: bool

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length


@dataclass(kw_only=True)
class SampleColumns:
    """Per-token and per-sample columns of n samples (T tokens in all, R response tokens).

    Sample i is ``tokens[token_offsets[i]:token_offsets[i+1]]`` (prompt + response); its
    response-token entries (``loss_masks``, ``rollout_log_probs``) are
    ``[response_offsets()[i]:response_offsets()[i+1]]``. Checked on construction.
    """

    tokens: npt.NDArray[np.int32]
    token_offsets: npt.NDArray[np.int64]
    response_lengths: npt.NDArray[np.int32]
    loss_masks: npt.NDArray[np.uint8]
    rewards: npt.NDArray[np.float32]
    advantages: npt.NDArray[np.float32]
    rollout_log_probs: npt.NDArray[np.float32]
    has_rollout_log_probs: npt.NDArray[np.bool_]
    sample_indices: npt.NDArray[np.int64]
    group_indices: npt.NDArray[np.int64]
    weight_versions: npt.NDArray[np.int32]
    """The version that sampled each sample's last token."""
    first_weight_versions: npt.NDArray[np.int32]
    """The version that sampled each sample's first token (its oldest)."""
    statuses: npt.NDArray[np.uint8]
    truncated: npt.NDArray[np.bool_]

    def __post_init__(self) -> None:
        check_columns(self)

    @property
    def num_samples(self) -> int:
        return len(self.response_lengths)

    def total_lengths(self) -> npt.NDArray[np.int64]:
        """Prompt + response tokens per sample (what the DP schedule balances)."""
        return np.diff(self.token_offsets)

    def response_offsets(self) -> npt.NDArray[np.int64]:
        """Offsets of each sample's entries in the response-token columns (n + 1 entries)."""
        out = np.zeros(self.num_samples + 1, dtype=np.int64)
        np.cumsum(self.response_lengths, out=out[1:])
        return out

    def columns(self) -> dict[str, npt.NDArray[Any]]:
        """All column arrays by name."""
        return {name: getattr(self, name) for name in COLUMNS}

    def rows(self, start: int, end: int) -> SampleColumns:
        """Samples [start, end) as views (offsets rebased), e.g. one micro-batch."""
        if not 0 <= start <= end <= self.num_samples:
            raise IndexError(f"rows [{start}, {end}) outside 0..{self.num_samples}")
        off, roff = self.token_offsets, self.response_offsets()
        cols: dict[str, Any] = {name: getattr(self, name)[start:end] for name in SAMPLE_COLUMNS}
        cols["tokens"] = self.tokens[off[start] : off[end]]
        cols["token_offsets"] = off[start : end + 1] - off[start]
        for name in RESPONSE_COLUMNS:
            cols[name] = getattr(self, name)[roff[start] : roff[end]]
        return SampleColumns(**cols)

    def sample(self, i: int) -> SampleRow:
        """Sample i of this batch."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} outside 0..{self.num_samples - 1}")
        roff = self.response_offsets()
        r0, r1 = roff[i], roff[i + 1]
        has_lp = bool(self.has_rollout_log_probs[i])
        return SampleRow(
            tokens=self.tokens[self.token_offsets[i] : self.token_offsets[i + 1]],
            response_length=int(self.response_lengths[i]),
            loss_mask=self.loss_masks[r0:r1],
            rollout_log_probs=self.rollout_log_probs[r0:r1] if has_lp else None,
            reward=float(self.rewards[i]),
            advantage=float(self.advantages[i]),
            index=int(self.sample_indices[i]),
            group_index=int(self.group_indices[i]),
            weight_version=int(self.weight_versions[i]),
            first_weight_version=int(self.first_weight_versions[i]),
            status=STATUS_CODES[int(self.statuses[i])],
            truncated=bool(self.truncated[i]),
        )


@dataclass(kw_only=True)
class RolloutBatch(SampleColumns):
    """A whole rollout, columnar, as the rollout manager's batch builder makes it (seed step 30).

    ``batch_id`` is deterministic (e.g. ``f"{run_id}:{rollout_id}:{attempt}"``) so that a
    republished or redelivered batch is recognised and trained only once.
    """

    batch_id: str
    run_id: str
    rollout_id: int
    weight_version: int
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_samples(
        cls,
        samples: Sequence[Sample],
        *,
        batch_id: str,
        run_id: str,
        rollout_id: int,
        weight_version: int,
        advantages: Sequence[float],
        metrics: Mapping[str, float] | None = None,
    ) -> RolloutBatch:
        """Columns of ``samples`` in their order; ``advantages`` are the group-normalised rewards.

        A sample without a reward gets NaN, one without an index / group index gets -1, one
        without a weight version gets ``weight_version`` (what the engines held), one without a
        first weight version its weight version.
        """
        if len(advantages) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
        return cls(
            **_columns_from_samples(samples, weight_version),
            advantages=np.asarray(advantages, dtype=np.float32),
            batch_id=batch_id,
            run_id=run_id,
            rollout_id=rollout_id,
            weight_version=weight_version,
            metrics={str(k): float(v) for k, v in (metrics or {}).items()},
        )


@dataclass(kw_only=True)
class RankBatch(SampleColumns):
    """One DP rank's share of a rollout, re-ordered in training order (what a trainer rank reads).

    ``micro_batches`` are consecutive [start, end) row ranges; the first ``num_microbatches[0]``
    of them make optimizer step 0, the next ``num_microbatches[1]`` step 1, and so on.
    """

    batch_id: str
    run_id: str
    rollout_id: int
    weight_version: int
    dp_rank: int
    dp_size: int
    micro_batches: list[tuple[int, int]]
    num_microbatches: list[int]
    global_batch_size: int
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_schedule(self)

    def micro_batch(self, k: int) -> SampleColumns:
        """Micro-batch k as views into this batch."""
        start, end = self.micro_batches[k]
        return self.rows(start, end)


_META_FIELDS = tuple(f.name for f in fields(RankBatch) if f.name not in COLUMNS)


def split_by_dp(batch: RolloutBatch, schedule: DPSchedule) -> list[RankBatch]:
    """One `RankBatch` per DP rank from ``build_dp_schedule(batch.total_lengths(), ...)`` (seed step 31)."""
    covered = sorted(i for part in schedule.partitions for i in part)
    if covered != list(range(batch.num_samples)):
        raise ValueError(
            f"the schedule covers {len(covered)} sample slots, not each of the batch's "
            f"{batch.num_samples} samples once: was it built for this batch?"
        )
    if len(set(schedule.global_batch_sizes)) > 1:
        raise ValueError(f"steps of different sizes are not supported: {schedule.global_batch_sizes}")
    out = []
    for rank, part in enumerate(schedule.partitions):
        bounds, start = [], 0
        for mb in schedule.micro_batch_indices[rank]:
            bounds.append((start, start + len(mb)))
            start += len(mb)
        if [i for mb in schedule.micro_batch_indices[rank] for i in mb] != part:
            raise ValueError(f"rank {rank}: micro-batches do not list the partition in order")
        out.append(
            RankBatch(
                **_gather(batch, part),
                batch_id=batch.batch_id,
                run_id=batch.run_id,
                rollout_id=batch.rollout_id,
                weight_version=batch.weight_version,
                dp_rank=rank,
                dp_size=len(schedule.partitions),
                micro_batches=bounds,
                num_microbatches=list(schedule.num_microbatches),
                global_batch_size=schedule.global_batch_sizes[0],
                metrics=dict(batch.metrics),
            )
        )
    return out


class _EncodedArray(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: list[int]
    data: bytearray  # bytearray, not bytes: np.frombuffer then gives writable arrays


class _Header(msgspec.Struct):
    magic: str = ""
    version: int = -1


_META_TYPES = get_type_hints(RankBatch)
_Envelope = msgspec.defstruct(
    "_Envelope",
    [
        ("magic", str),
        ("version", int),
        *((name, _META_TYPES[name]) for name in _META_FIELDS),
        ("arrays", dict[str, _EncodedArray]),
    ],
)
"""The whole blob: magic, version, `RankBatch`'s metadata fields (derived, so the two cannot drift
apart), and the column arrays."""


def encode_rank_batch(rb: RankBatch) -> bytes:
    """The blob for one rank: msgpack envelope, each array as ``{dtype, shape, data}`` raw bytes."""
    arrays = {}
    for name, arr in rb.columns().items():
        arr = np.ascontiguousarray(arr)
        arrays[name] = {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.data}
    meta = {name: getattr(rb, name) for name in _META_FIELDS}
    return msgspec.msgpack.encode(
        {"magic": FORMAT_MAGIC, "version": FORMAT_VERSION, **meta, "arrays": arrays}
    )


def decode_rank_batch(data: bytes | bytearray | memoryview) -> RankBatch:
    """Read a blob written by `encode_rank_batch`; anything malformed raises `BatchFormatError`."""
    try:
        header = msgspec.msgpack.decode(data, type=_Header)
        if header.magic != FORMAT_MAGIC:
            raise BatchFormatError(f"not a rank batch: magic is {header.magic!r}, expected {FORMAT_MAGIC!r}")
        if header.version != FORMAT_VERSION:
            raise BatchFormatError(
                f"rank batch format version {header.version} is not supported (this build reads {FORMAT_VERSION})"
            )
        env: Any = msgspec.msgpack.decode(data, type=_Envelope)
    except msgspec.DecodeError as e:  # ValidationError is a subclass
        raise BatchFormatError(f"rank batch blob is malformed ({len(data)} bytes): {e}") from e
    missing = COLUMNS.keys() - env.arrays.keys()
    extra = env.arrays.keys() - COLUMNS.keys()
    try:
        if missing or extra:
            raise BatchFormatError(f"missing arrays {sorted(missing)}, unexpected arrays {sorted(extra)}")
        cols: dict[str, Any] = {name: _decode_array(name, env.arrays[name]) for name in COLUMNS}
        return RankBatch(**cols, **{name: getattr(env, name) for name in _META_FIELDS})
    except BatchFormatError as e:
        raise BatchFormatError(f"rank batch blob of {env.batch_id!r} rank {env.dp_rank}: {e}") from None


def _decode_array(name: str, enc: _EncodedArray) -> npt.NDArray[Any]:
    expected = COLUMNS[name]
    if enc.dtype != expected.str:
        raise BatchFormatError(f"array {name!r}: dtype {enc.dtype!r}, expected {expected.str!r}")
    if len(enc.shape) != 1 or enc.shape[0] < 0:
        raise BatchFormatError(f"array {name!r}: shape {enc.shape}, expected one non-negative dimension")
    if enc.shape[0] * expected.itemsize != len(enc.data):
        raise BatchFormatError(
            f"array {name!r}: {len(enc.data)} data bytes for shape {enc.shape} of {expected.str} "
            f"(expected {enc.shape[0] * expected.itemsize})"
        )
    return np.frombuffer(enc.data, dtype=expected)


def _columns_from_samples(samples: Sequence[Sample], default_version: int) -> dict[str, Any]:
    """All columns but advantages; each sample is checked for consistent per-token lists first."""
    for i, s in enumerate(samples):
        try:
            s.check_consistent()
        except ValueError as e:
            raise ValueError(f"sample {i} (index {s.index}): {e}") from e
    lengths = [len(s.tokens) for s in samples]
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n_resp = sum(s.response_length for s in samples)
    log_probs = np.full(n_resp, np.nan, dtype=np.float32)
    pos = 0
    for s in samples:
        if s.rollout_log_probs is not None:
            log_probs[pos : pos + s.response_length] = s.rollout_log_probs
        pos += s.response_length
    return {
        "tokens": _concat([s.tokens for s in samples], np.int32),
        "token_offsets": offsets,
        "response_lengths": np.array([s.response_length for s in samples], dtype=np.int32),
        "loss_masks": _concat([s.loss_mask for s in samples], np.uint8),
        "rewards": np.array([np.nan if s.reward is None else s.reward for s in samples], dtype=np.float32),
        "rollout_log_probs": log_probs,
        "has_rollout_log_probs": np.array([s.rollout_log_probs is not None for s in samples], dtype=np.bool_),
        "sample_indices": np.array([-1 if s.index is None else s.index for s in samples], dtype=np.int64),
        "group_indices": np.array(
            [-1 if s.group_index is None else s.group_index for s in samples], dtype=np.int64
        ),
        "weight_versions": np.array([_version(s, default_version) for s in samples], dtype=np.int32),
        "first_weight_versions": np.array(
            [_version(s, default_version, first=True) for s in samples], dtype=np.int32
        ),
        "statuses": np.array([STATUS_CODES.index(s.status) for s in samples], dtype=np.uint8),
        "truncated": np.array([s.status == SampleStatus.TRUNCATED for s in samples], dtype=np.bool_),
    }


def _version(s: Sample, default: int, first: bool = False) -> int:
    value = s.first_weight_version if first and s.first_weight_version is not None else s.weight_version
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"sample {s.index}: weight version {value!r} is not an integer") from None


def _concat(lists: list[list[int]], dtype: type[np.generic]) -> npt.NDArray[Any]:
    return np.fromiter(chain.from_iterable(lists), dtype=dtype, count=sum(map(len, lists)))


def _gather(c: SampleColumns, rows: Sequence[int]) -> dict[str, Any]:
    """Copies of all columns for ``rows`` in that order (offsets rebuilt)."""
    idx = np.asarray(rows, dtype=np.int64)
    cols: dict[str, Any] = {name: getattr(c, name)[idx] for name in SAMPLE_COLUMNS}
    cols["tokens"], cols["token_offsets"] = gather_ragged(c.tokens, c.token_offsets, idx)
    roff = c.response_offsets()
    for name in RESPONSE_COLUMNS:
        cols[name], _ = gather_ragged(getattr(c, name), roff, idx)
    return cols
