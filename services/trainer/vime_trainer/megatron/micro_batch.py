"""Turn a micro-batch of a `RankBatch` into the tensors one forward/loss needs, padded or packed.

Padded: samples are right-padded into ``[b, s]`` (causal attention never lets padding reach a real
token); hidden states come out as ``[s, b, h]`` and position ``pos`` of row ``j`` has flat index
``pos·b + j``. Packed: the samples are concatenated into one ``[1, T]`` sequence (T = the sum of
their lengths, no padding) with per-sample positions (RoPE restarts at 0 for each sample) and the
sample boundaries (`PackedSamples`) that the core attention keeps every token within; hidden states
come out as ``[T, 1, h]`` and position ``pos`` of sample ``j`` has flat index ``offset_j + pos``.
Either way response token t of sample j is predicted by the hidden state at position
``prompt_len_j + t − 1``, and everything downstream of the hidden states (log-probs, loss) sees the
same per-token arrays. Per-token advantages are the sample's advantage broadcast over its response
(`get_grpo_returns`, seed step 39).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from vime.algorithms import get_grpo_returns
from vime.batch import SampleColumns


@dataclass
class PackedSamples(PackedSeqParams):
    """Boundaries of the samples packed into one sequence, as Megatron passes them to core attention.

    ``qkv_format`` is ``"sbhd"``: the packed tensors are an ordinary ``[s=T, b=1, ...]`` batch to
    Megatron, so it applies RoPE with the per-token frequencies `PolicyModel` gathers from the
    per-sample positions, rather than its ``thd`` path (which splits every layer's q and k per
    sample and reads the boundaries back from the device). ``bounds`` are the same boundaries on
    the host (for attention that loops over samples), ``cache`` holds what an attention kernel
    derives from them once per micro-batch (e.g. a block mask) instead of once per layer.
    """

    bounds: tuple[int, ...] = ()
    cache: dict[str, Any] = field(default_factory=dict)


@dataclass
class MicroBatch:
    """Tensors of one micro-batch on the rank's device (R = response tokens in it)."""

    tokens: torch.Tensor  # [b, s] int64 right-padded, or [1, T] packed
    position_ids: torch.Tensor  # same shape as tokens
    index: torch.Tensor  # [R] flat index into hidden.reshape(-1, h)
    targets: torch.Tensor  # [R] response token ids
    loss_mask: torch.Tensor  # [R] float32
    advantages: torch.Tensor  # [R] float32
    rollout_log_probs: torch.Tensor  # [R] float32, NaN where a sample carries none
    has_rollout_log_probs: torch.Tensor  # [R] bool
    response_lengths: list[int]
    sample_index: torch.Tensor | None = None  # [R] int64, each response token's sample
    packing: PackedSamples | None = None
    """Sample boundaries when the samples are packed into one sequence (None: right-padded)."""
    sample_lengths: list[int] = field(default_factory=list)
    """Prompt + response tokens per sample."""

    @property
    def num_samples(self) -> int:
        return len(self.response_lengths)

    @property
    def seq_length(self) -> int:
        """Length of the model's sequence dimension (the longest sample, or T when packed)."""
        return int(self.tokens.shape[1])

    @property
    def micro_batch_size(self) -> int:
        """Size of the model's batch dimension (1 when packed)."""
        return int(self.tokens.shape[0])

    @property
    def real_tokens(self) -> int:
        """Prompt + response tokens of the samples (what the model must process)."""
        return sum(self.sample_lengths)

    @property
    def padded_tokens(self) -> int:
        """Token slots the model processes (b × s; T when packed)."""
        return self.micro_batch_size * self.seq_length

    def causal_mask(self) -> torch.Tensor:
        """Explicit ``[1, 1, s, s]`` mask (True = masked) for Megatron's unfused local attention."""
        if self.packing is not None:
            raise ValueError("Megatron's local attention takes padded micro-batches only")
        s = self.seq_length
        return torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.tokens.device), 1)[None, None]


def make_micro_batch(cols: SampleColumns, device: str | torch.device, packed: bool = False) -> MicroBatch:
    """Pad (or pack) and index one micro-batch's samples (``RankBatch.micro_batch(k)``)."""
    lengths = np.diff(cols.token_offsets).astype(np.int64)
    resp = cols.response_lengths.astype(np.int64)
    prompts = lengths - resp
    if len(lengths) == 0:
        raise ValueError("empty micro-batch")
    if (prompts < 1).any():
        bad = int(np.flatnonzero(prompts < 1)[0])
        raise ValueError(f"sample {bad} of the micro-batch has no prompt token to predict its response from")
    starts = cols.token_offsets[:-1].astype(np.int64)
    # Position (within its sample) of the hidden state predicting each response token, and its sample.
    row = np.repeat(np.arange(len(lengths)), resp)
    pos = np.arange(len(row)) - np.repeat(np.cumsum(resp) - resp, resp) + np.repeat(prompts - 1, resp)
    targets = cols.tokens[starts[row] + pos + 1].astype(np.int64)
    returns = get_grpo_returns([float(a) for a in cols.advantages], [int(r) for r in resp])
    advantages = np.fromiter((a for r in returns for a in r), dtype=np.float32, count=len(pos))
    has_lp = np.repeat(cols.has_rollout_log_probs.astype(bool), resp)

    to_gpu = torch.device(device).type == "cuda"

    def t(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(x, dtype=dtype)  # a copy: batch arrays may be read-only
        if not to_gpu:
            return host
        # from pinned memory the copy is queued, not waited for (a pageable one blocks the host)
        return host.pin_memory().to(device, non_blocking=True)

    packing = None
    if packed:
        total = int(lengths.sum())
        tokens = cols.tokens.astype(np.int64).reshape(1, total)
        positions = (np.arange(total) - np.repeat(starts, lengths)).reshape(1, total)
        index = starts[row] + pos
        bounds = np.asarray(cols.token_offsets, dtype=np.int64)
        cu = t(bounds, torch.int32)
        packing = PackedSamples(
            qkv_format="sbhd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=int(lengths.max()),
            max_seqlen_kv=int(lengths.max()),
            bounds=tuple(int(x) for x in bounds),
        )
    else:
        b, s = len(lengths), int(lengths.max())
        tokens = np.zeros((b, s), dtype=np.int64)
        for j, (off, n) in enumerate(zip(starts, lengths, strict=True)):
            tokens[j, :n] = cols.tokens[off : off + n]
        positions = np.broadcast_to(np.arange(s), (b, s))
        index = pos * b + row
    return MicroBatch(
        tokens=t(tokens, torch.long),
        position_ids=t(positions, torch.long),
        index=t(index, torch.long),
        targets=t(targets, torch.long),
        loss_mask=t(cols.loss_masks, torch.float32),
        advantages=t(advantages, torch.float32),
        rollout_log_probs=t(cols.rollout_log_probs, torch.float32),
        has_rollout_log_probs=t(has_lp, torch.bool),
        response_lengths=[int(r) for r in resp],
        sample_index=t(row, torch.long),
        packing=packing,
        sample_lengths=[int(n) for n in lengths],
    )
