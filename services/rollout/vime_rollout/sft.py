"""Supervised warm-up batches (``trainer.sft_warmup_steps``): prompts with their labels as responses.

The trainer's warm-up needs (prompt, label) token pairs, and only the data source has them. Warm-up
step k takes the k-th slice of ``global_batch_size`` prompts of an order of its own (shuffled per
epoch like the RL order, from another seed), one sample per prompt: the warm-up neither moves the
RL data position nor depends on it, and a step asked for twice gives the same examples.

The label is the text the model should emit: for the built-in arithmetic task the sum ("46"), for
a data file the record's ``data.label_key`` field as text. So a warm-up fits only data whose label
*is* the answer text, not a verifier's spec (a list of test cases, a dict): a label that is not a
string or a number is refused. The response is the label's tokens plus the tokenizer's EOS, cut at
``rollout_max_response_len``, all in the loss mask, with reward and advantage 1.0, so the trainer's
micro-batching, DP split and Redis transport are exactly those of an RL batch. Warm-up batches
travel on their own stream (the run id + ``:sft``), where an RL reader never meets one.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from vime.algorithms import build_dp_schedule
from vime.batch import RolloutBatch, split_by_dp
from vime.config import RunConfig
from vime.types import Sample, SampleStatus
from vime_rollout.batch_builder import BatchBuildError, BuiltBatch
from vime_rollout.data import PromptDataset, PromptTemplate, Tokenizer

SFT_STREAM_SUFFIX = ":sft"
"""Warm-up batches are published under run id ``<run_id>:sft`` (their own Redis stream)."""


class SftLabelError(ValueError):
    """A label that is not text the model could be taught to emit."""


def sft_stream_run_id(run_id: str) -> str:
    return run_id + SFT_STREAM_SUFFIX


def label_text(label: Any, label_key: str) -> str:
    """The text a label stands for: a string as is, a number written out; anything else refused."""
    if isinstance(label, str) and label.strip():
        return label
    if isinstance(label, int | float) and not isinstance(label, bool):
        return str(label)
    raise SftLabelError(
        f"label {label!r} (data.label_key={label_key!r}) is not text the model should emit: the SFT "
        "warm-up needs labels that are the answer text (set trainer.sft_warmup_steps=0 for this data)"
    )


class SftExamples:
    """The warm-up's (prompt, label) examples of a dataset, in a per-epoch order of their own."""

    def __init__(
        self,
        dataset: PromptDataset,
        tokenizer: Tokenizer,
        *,
        label_key: str,
        max_response_len: int,
        shuffle: bool,
        seed: int,
    ) -> None:
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.label_key = label_key
        self.max_response_len = max_response_len
        self.shuffle = shuffle
        self.seed = seed
        self.eos: int | None = getattr(tokenizer, "eos_token_id", None)
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(f"{self.seed}:sft:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # steps go forward: one epoch's order is enough
        return self._orders[epoch]

    def templates(self, step: int, count: int) -> list[tuple[int, PromptTemplate]]:
        """(position, prompt) of step ``step``'s ``count`` examples; positions count over epochs."""
        n = len(self.dataset)
        out = []
        for pos in range(step * count, (step + 1) * count):
            out.append((pos, self.dataset.prompts[self._order(pos // n)[pos % n]]))
        return out

    def label_tokens(self, label: Any) -> list[int]:
        """The label's tokens and the EOS (the model learns to stop), cut at the response limit."""
        tokens = list(self.tokenizer.encode(label_text(label, self.label_key), add_special_tokens=False))
        if not tokens:
            raise SftLabelError(f"label {label!r} (data.label_key={self.label_key!r}) tokenises to nothing")
        if self.eos is not None:
            tokens.append(int(self.eos))
        return tokens[: self.max_response_len]

    def samples(self, step: int, count: int) -> list[Sample]:
        """Step ``step``'s samples: prompt + label tokens, the label fully in the loss mask."""
        out = []
        for pos, t in self.templates(step, count):
            label = self.label_tokens(t.label)
            out.append(
                Sample(
                    prompt=t.prompt,
                    label=t.label,
                    tokens=[*t.token_ids, *label],
                    response_length=len(label),
                    loss_mask=[1] * len(label),
                    reward=1.0,
                    status=SampleStatus.COMPLETED,
                    group_index=pos,
                    index=pos,
                    metadata=dict(t.metadata),
                )
            )
        return out


def build_sft_batch(
    cfg: RunConfig, samples: list[Sample], *, batch_id: str, run_id: str, step: int, dp_size: int
) -> BuiltBatch:
    """One optimizer step's batch (every sample, advantage 1.0) and its DP shares."""
    n = len(samples)
    if not n or n % (cfg.micro_batch_size * dp_size):
        raise BatchBuildError(
            f"{n} warm-up samples do not split into micro_batch_size={cfg.micro_batch_size} × "
            f"dp_size={dp_size}"
        )
    metrics = {
        "sft/prompt_len_mean": statistics.fmean(s.prompt_length for s in samples),
        "sft/label_len_mean": statistics.fmean(s.response_length for s in samples),
    }
    batch = RolloutBatch.from_samples(
        samples,
        batch_id=batch_id,
        run_id=run_id,
        rollout_id=step,
        weight_version=0,
        advantages=[1.0] * n,
        metrics=metrics,
    )
    schedule = build_dp_schedule([int(x) for x in batch.total_lengths()], n, cfg.micro_batch_size, dp_size)
    return BuiltBatch(batch, split_by_dp(batch, schedule))
