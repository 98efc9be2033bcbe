"""Turn a micro-batch of a `RankBatch` into the tensors one forward/loss needs.

Samples are right-padded into ``[b, s]`` (causal attention never lets padding reach a real token).
The model's hidden states come out as ``[s, b, h]``; response token t of row j is predicted by
the hidden state at position ``prompt_len_j + t − 1``, whose flat index is ``pos·b + j``. Per-token
advantages are the sample's advantage broadcast over its response (`get_grpo_returns`, seed step 39).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vime.algorithms import get_grpo_returns
from vime.batch import SampleColumns


@dataclass
class MicroBatch:
    """Tensors of one micro-batch on the rank's device (R = response tokens in it)."""

    tokens: torch.Tensor  # [b, s] int64, right-padded
    position_ids: torch.Tensor  # [b, s]
    index: torch.Tensor  # [R] flat index into hidden.reshape(s·b, h)
    targets: torch.Tensor  # [R] response token ids
    loss_mask: torch.Tensor  # [R] float32
    advantages: torch.Tensor  # [R] float32
    rollout_log_probs: torch.Tensor  # [R] float32, NaN where a sample carries none
    has_rollout_log_probs: torch.Tensor  # [R] bool
    response_lengths: list[int]

    @property
    def num_samples(self) -> int:
        return len(self.response_lengths)

    @property
    def seq_length(self) -> int:
        return int(self.tokens.shape[1])

    def causal_mask(self) -> torch.Tensor:
        """Explicit ``[1, 1, s, s]`` mask (True = masked) for Megatron's unfused local attention."""
        s = self.seq_length
        return torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.tokens.device), 1)[None, None]


def make_micro_batch(cols: SampleColumns, device: str | torch.device) -> MicroBatch:
    """Pad and index one micro-batch's samples (``RankBatch.micro_batch(k)``)."""
    lengths = np.diff(cols.token_offsets).astype(np.int64)
    resp = cols.response_lengths.astype(np.int64)
    prompts = lengths - resp
    if len(lengths) == 0:
        raise ValueError("empty micro-batch")
    if (prompts < 1).any():
        bad = int(np.flatnonzero(prompts < 1)[0])
        raise ValueError(f"sample {bad} of the micro-batch has no prompt token to predict its response from")
    b, s = len(lengths), int(lengths.max())
    tokens = np.zeros((b, s), dtype=np.int64)
    rows, positions = [], []
    for j, (off, n, p, r) in enumerate(zip(cols.token_offsets[:-1], lengths, prompts, resp, strict=True)):
        tokens[j, :n] = cols.tokens[off : off + n]
        positions.append(np.arange(p - 1, p - 1 + r, dtype=np.int64))
        rows.append(np.full(r, j, dtype=np.int64))
    pos = np.concatenate(positions)
    row = np.concatenate(rows)
    targets = tokens[row, pos + 1]
    returns = get_grpo_returns([float(a) for a in cols.advantages], [int(r) for r in resp])
    has_lp = np.repeat(cols.has_rollout_log_probs.astype(bool), resp)

    def t(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=device)  # a copy: batch arrays may be read-only

    return MicroBatch(
        tokens=t(tokens, torch.long),
        position_ids=torch.arange(s, device=device).unsqueeze(0).expand(b, s),
        index=t(pos * b + row, torch.long),
        targets=t(targets, torch.long),
        loss_mask=t(cols.loss_masks, torch.float32),
        advantages=t(
            np.fromiter((a for r in returns for a in r), dtype=np.float32, count=len(pos)), torch.float32
        ),
        rollout_log_probs=t(cols.rollout_log_probs, torch.float32),
        has_rollout_log_probs=t(has_lp, torch.bool),
        response_lengths=[int(r) for r in resp],
    )
