"""One rollout's training on one rank (seed steps 38–40) and the supervised warm-up step.

Step 38: old log-probs are reused from the loss's own forward (old = current.detach()) when
`can_reuse_log_probs_in_loss` allows it; otherwise they are first computed with the current
weights by a no-grad pass over *all* micro-batches, shared by every optimizer step of the rollout
(or taken from the rollout when ``use_rollout_logprobs``). With ``kl_coef > 0`` reference
log-probs come from the same kind of pass with the reference weights swapped in. Step 39:
per-token advantages (`micro_batch`). Step 40: per optimizer step, forward/backward over its
``num_microbatches[s]`` micro-batches and one optimizer step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

import torch
from torch.profiler import record_function

from vime.algorithms import can_reuse_log_probs_in_loss
from vime.algorithms.off_policy import Correction
from vime.batch import RankBatch
from vime.config import RunConfig
from vime_trainer.megatron.loss import LossSettings, forward_log_probs, policy_loss, sft_loss
from vime_trainer.megatron.memory import WeightBackup
from vime_trainer.megatron.micro_batch import MicroBatch, make_micro_batch
from vime_trainer.megatron.passes import Passes

StepMetrics = dict[str, float]
MICRO_BATCH_RANGE = "vime/micro_batches"
"""Profiler range around building a batch's micro-batch tensors on the host and copying them over."""


class PhaseClock:
    """Seconds of each part of a rank's training, as ``t_<part>_s`` metrics. On the GPU each mark
    waits for the compute stream first, so a part is charged its kernels rather than their
    launches (not for the side stream that brings the optimizer's state back after a wake-up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, part: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        now = time.perf_counter()
        self.seconds[f"t_{part}_s"] = self.seconds.get(f"t_{part}_s", 0.0) + now - self._last
        self._last = now


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has built in this process so far, recompiles included.

    A step that adds any spent part of its time compiling: on the H100 a steady step that recompiled
    the log-prob kernels for a new chunk length trained 2.4 s longer (docs/benchmarks.md).
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class TrainStep:
    """The training logic of one rank, on top of `Passes`."""

    def __init__(
        self, passes: Passes, config: RunConfig, backup: WeightBackup, device: str, dp_size: int
    ) -> None:
        self.passes = passes
        self.config = config
        self.backup = backup
        self.device = device
        self.dp_size = dp_size

    def micro_batches(self, batch: RankBatch) -> list[MicroBatch]:
        """The batch's micro-batches on the device, padded or packed (``trainer.packed_sequences``)."""
        if batch.dp_size != self.dp_size:
            raise ValueError(f"batch is split for dp_size={batch.dp_size} but the trainer has {self.dp_size}")
        packed = self.config.trainer.packed_sequences
        with record_function(MICRO_BATCH_RANGE):
            return [
                make_micro_batch(batch.micro_batch(k), self.device, packed)
                for k in range(len(batch.micro_batches))
            ]

    def settings(self, batch: RankBatch, num_microbatches: int) -> LossSettings:
        c = self.config
        return LossSettings(
            eps_clip=c.eps_clip,
            eps_clip_high=c.eps_clip_high if c.eps_clip_high is not None else c.eps_clip,
            eps_clip_c=c.eps_clip_c,
            kl_coef=c.kl_coef,
            kl_loss_type=c.trainer.kl_loss_type,
            entropy_coef=c.entropy_coef,
            global_batch_size=batch.global_batch_size,
            num_microbatches=num_microbatches,
            dp_size=self.dp_size,
            chunk_size=c.trainer.logprob_chunk_size,
            temperature=c.rollout_temperature,
            correction=Correction.of(c),
        )

    def log_probs(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """No-grad log-probs of every micro-batch with the current weights (last stage; [] elsewhere)."""
        t, temperature = self.config.trainer, self.config.rollout_temperature
        outputs = self.passes.forward_only(
            mbs,
            lambda k, mb, hidden: forward_log_probs(
                self.passes.model.output_logits,
                hidden,
                mb,
                t.logprob_chunk_size,
                temperature,
            ),
        )
        return [o["log_probs"] for o in outputs]

    def reference_log_probs(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """Log-probs under the reference weights (swapped in, then the actor's restored)."""
        self.backup.backup("actor")
        self.backup.restore("ref")
        try:
            return self.log_probs(mbs)
        finally:
            self.backup.restore("actor")

    def train(self, batch: RankBatch) -> list[StepMetrics]:
        """Train on this rank's share of a rollout; one metrics dict per optimizer step (the first
        also carries the seconds of each part, `PhaseClock`, and the graphs compiled meanwhile)."""
        clock = PhaseClock()
        graphs = compiled_graphs()
        mbs = self.micro_batches(batch)
        clock.mark("micro_batches")
        c = self.config
        reuse = can_reuse_log_probs_in_loss(c, batch.num_microbatches)
        train_lp: list[torch.Tensor] | None = None
        if (not c.use_rollout_logprobs or c.get_mismatch_metrics) and not reuse:
            train_lp = self.log_probs(mbs)
            clock.mark("log_probs")
        old = [mb.rollout_log_probs for mb in mbs] if c.use_rollout_logprobs else train_lp
        if c.use_rollout_logprobs:
            _require_rollout_log_probs(mbs)
        ref = self.reference_log_probs(mbs) if c.kl_coef > 0 else None
        if ref is not None:
            clock.mark("reference_log_probs")
        bounds = [0, *accumulate(batch.num_microbatches)]
        results = []
        for s, n in enumerate(batch.num_microbatches):
            settings = self.settings(batch, n)
            lo = bounds[s]

            def loss_fn(
                k: int, mb: MicroBatch, hidden: torch.Tensor, lo: int = lo, st: LossSettings = settings
            ) -> Any:
                return policy_loss(
                    self.passes.model.output_logits,
                    hidden,
                    mb,
                    st,
                    old_log_probs=None if old is None else old[lo + k],
                    ref_log_probs=None if ref is None else ref[lo + k],
                    train_log_probs=None if train_lp is None else train_lp[lo + k],
                )

            results.append(self.passes.step(mbs[bounds[s] : bounds[s + 1]], loss_fn))
        clock.mark("passes")
        self.backup.backup("actor")  # seed step 41: pushes to engines while the model sleeps read it
        clock.mark("backup")
        results[0] |= clock.seconds
        results[0]["compiled_graphs"] = float(compiled_graphs() - graphs)
        return results

    def train_sft(self, batch: RankBatch) -> list[StepMetrics]:
        """Supervised steps on (prompt, label) samples: cross-entropy on the label tokens."""
        mbs = self.micro_batches(batch)
        bounds = [0, *accumulate(batch.num_microbatches)]
        results = []
        with self._learning_rate(self.config.trainer.sft_lr):
            for s, n in enumerate(batch.num_microbatches):
                settings = self.settings(batch, n)

                def loss_fn(k: int, mb: MicroBatch, hidden: torch.Tensor, st: LossSettings = settings) -> Any:
                    return sft_loss(self.passes.model.output_logits, hidden, mb, st)

                results.append(self.passes.step(mbs[bounds[s] : bounds[s + 1]], loss_fn))
        self.backup.backup("actor")
        return results

    @contextlib.contextmanager
    def _learning_rate(self, lr: float | None) -> Iterator[None]:
        """Train at ``lr`` inside the block (None: unchanged), then restore the RL learning rate."""
        groups = self.passes.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        if lr is not None:
            for g in groups:
                g["lr"] = lr
        try:
            yield
        finally:
            for g, old in zip(groups, saved, strict=True):
                g["lr"] = old


def _require_rollout_log_probs(mbs: list[MicroBatch]) -> None:
    for k, mb in enumerate(mbs):
        needed = mb.loss_mask > 0
        if not bool(mb.has_rollout_log_probs[needed].all()):
            raise ValueError(
                f"use_rollout_logprobs is set but micro-batch {k} has samples without rollout log-probs"
            )
