"""Helpers of the Megatron trainer tests: Ray, configs, rank batches published to Redis, and an
independent HF reference step."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vime_trainer.batches import BatchRef

from vime.algorithms import build_dp_schedule
from vime.batch import RankBatch, RolloutBatch, split_by_dp
from vime.config import RunConfig, load_config
from vime.queue import BatchPublisher
from vime.types import Sample, SampleStatus

SEED_ADVANTAGE = 0.9354  # seed step 30: rewards [1,0,0,1,1,0,1,0] normalise to ±0.9354


@contextmanager
def local_ray(**init: Any) -> Iterator[None]:
    """Ray for the ranks' actors: started here (``init`` passed on) unless one is up, which is left up."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False, **init)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def run_config(tmp: Path, tp: int = 1, ranks: int = 1, pp: int = 1, **top: Any) -> RunConfig:
    """A CPU training config: 2 prompts × 4 samples, micro-batches of 2."""
    trainer = {
        "lr": 1e-3,
        "checkpoint_dir": str(tmp / "ckpt"),
        "logprob_chunk_size": 7,
        **top.pop("trainer", {}),
    }
    base = {
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 4,
        "micro_batch_size": 2,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "actor_num_gpus_per_node": 0,
        "actor_num_cpu_ranks": ranks,
        "rollout_num_gpus": 0,
        "colocate": False,
        "trainer": trainer,
        **top,
    }
    return load_config(base=base, environ={})


def rollout_batch(
    cfg: RunConfig, rollout_id: int, advantages: list[float] | None = None, seed: int = 0
) -> RolloutBatch:
    """Random prompts/responses (vocab of the kit), the seed's ±0.9354 advantages, a masked token or two."""
    rng = np.random.default_rng(seed)
    n = cfg.samples_per_rollout
    adv = advantages or [SEED_ADVANTAGE * (1 if r else -1) for r in [1, 0, 0, 1, 1, 0, 1, 0][:n]]
    samples = []
    for i in range(n):
        prompt = rng.integers(3, 128, size=int(rng.integers(3, 9))).tolist()
        response = rng.integers(3, 128, size=int(rng.integers(2, 7))).tolist()
        mask = [1] * len(response)
        if i % 3 == 2:
            mask[-1] = 0  # a masked response token must not count
        samples.append(
            Sample(
                tokens=prompt + response,
                response_length=len(response),
                loss_mask=mask,
                reward=float(adv[i] > 0),
                status=SampleStatus.COMPLETED,
                index=i,
                group_index=i // cfg.n_samples_per_prompt,
            )
        )
    return RolloutBatch.from_samples(
        samples,
        batch_id=f"b{rollout_id}",
        run_id="test",
        rollout_id=rollout_id,
        weight_version=rollout_id + 1,
        advantages=adv,
    )


def split(cfg: RunConfig, batch: RolloutBatch, dp_size: int | None = None) -> list[RankBatch]:
    """The batch's DP split as the rollout manager makes it (seed step 31)."""
    dp = dp_size or cfg.dp_size
    schedule = build_dp_schedule(
        batch.total_lengths().tolist(),
        cfg.global_batch_size or 0,
        cfg.micro_batch_size,
        dp,
        cfg.max_tokens_per_gpu,
    )
    return split_by_dp(batch, schedule)


class Publisher:
    """Publishes rank batches to Redis as the rollout manager does, each under a fresh batch id on
    a stream of its own, and returns the `BatchRef` the ranks read them by (`ActorGroup.train`)."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.stream = f"test-{uuid.uuid4().hex[:8]}"
        self._ids = itertools.count()

    def __call__(self, shares: Sequence[RankBatch]) -> BatchRef:
        batch_id = f"{self.stream}:{next(self._ids)}"
        shares = [replace(s, batch_id=batch_id, run_id=self.stream) for s in shares]
        first = shares[0]
        whole = SimpleNamespace(  # what the publisher checks of the whole batch
            batch_id=batch_id,
            run_id=self.stream,
            rollout_id=first.rollout_id,
            weight_version=first.weight_version,
            num_samples=sum(s.num_samples for s in shares),
            first_weight_versions=np.concatenate([s.first_weight_versions for s in shares]),
            metrics=first.metrics,
        )

        async def publish() -> None:
            async with BatchPublisher(self.redis_url, self.stream) as pub:
                await pub.publish(whole, shares)  # type: ignore[arg-type]

        asyncio.run(publish())
        return BatchRef(self.redis_url, self.stream, batch_id, first.rollout_id)


def with_rollout_log_probs(rb: RankBatch, log_probs: np.ndarray) -> RankBatch:
    """``rb`` with every sample carrying the given response-token log-probs."""
    return replace(
        rb,
        rollout_log_probs=log_probs.astype(np.float32),
        has_rollout_log_probs=np.ones(rb.num_samples, dtype=np.bool_),
    )


TokenWeights = Callable[[int, torch.Tensor], torch.Tensor]
"""(sample index, the sample's detached response log-probs) -> a weight per response token."""


def hf_reference(
    checkpoint: Path, batch: RolloutBatch, cfg: RunConfig, steps: int, weights: TokenWeights | None = None
) -> list[dict[str, float]]:
    """The same GRPO steps computed with the HF model and torch AdamW: loss, grad norm, entropy per step.

    One optimizer step per call, ratio 1 (old = current.detach()), per-sample token means over the
    loss mask divided by the batch size, grad-norm clipping at ``clip_grad``; ``weights`` multiply
    each token's policy-gradient loss (a TIS / MIS weight written out by the caller).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), attn_implementation="sdpa")
    t = cfg.trainer
    opt = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=1e-8, weight_decay=0.0
    )
    out = []
    for _ in range(steps):
        loss, entropy = torch.zeros(()), 0.0
        for i in range(batch.num_samples):
            s = batch.sample(i)
            p, r = s.prompt_length, s.response_length
            ids = torch.tensor(s.tokens, dtype=torch.long)[None]
            logp = torch.log_softmax(model(ids).logits[0, p - 1 : p - 1 + r].float(), dim=-1)
            lp = logp.gather(-1, ids[0, p:].unsqueeze(-1)).squeeze(-1)
            mask = torch.tensor(s.loss_mask, dtype=torch.float32)
            token_loss = -torch.exp(lp - lp.detach()) * s.advantage
            if weights is not None:
                token_loss = token_loss * weights(s.index, lp.detach())
            loss = loss + (token_loss * mask).sum() / mask.sum() / batch.num_samples
            ent = -(logp.exp() * logp).sum(-1)
            entropy += float((ent.detach() * mask).sum() / mask.sum()) / batch.num_samples
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        opt.step()
        opt.zero_grad()
        out.append({"loss": float(loss.detach()), "grad_norm": float(grad_norm), "entropy": entropy})
    return out


def hf_logits(checkpoint: Path, tokens: np.ndarray) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), attn_implementation="sdpa")
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def one(results: list[Any]) -> Any:
    """The single non-None per-rank result (e.g. logits from the last stage's TP rank 0)."""
    found = [r for r in results if r is not None]
    assert len(found) == 1, f"expected one rank to answer, got {len(found)}"
    return found[0]


def rank_gradients(cfg: RunConfig, checkpoint: Path, rb: RankBatch) -> dict[str, Any]:
    """One rank's accumulated gradients (per parameter) and log-probs (per response token, in the
    batch's row order) for the single optimizer step of ``rb``, without the update.

    Runs as a one-shot Ray task (its worker exits afterwards): a CPU rank installs the process-wide
    CPU shim, which must not stay in a process that runs anything else.
    """
    import ray

    from vime import procs

    @ray.remote(num_cpus=1, max_calls=1)
    def run(cfg: RunConfig, checkpoint: str, rb: RankBatch) -> dict[str, Any]:
        from vime_trainer.megatron.loss import policy_loss
        from vime_trainer.megatron.rank import TrainRank

        rank = TrainRank(0, 1, cfg, checkpoint)
        rank.setup("127.0.0.1", procs.free_port())
        try:
            steps, model = rank.steps, rank.passes.model
            mbs = steps.micro_batches(rb)
            log_probs = torch.cat(steps.log_probs(mbs))
            (n,) = rb.num_microbatches
            settings = steps.settings(rb, n)
            rank.ddp.zero_grad_buffer()
            outputs = rank.passes.run(
                mbs,
                lambda k, mb, hidden: policy_loss(model.output_logits, hidden, mb, settings, None, None),
                forward_only=False,
            )
            return {
                "grads": {n: p.main_grad.detach().clone().numpy() for n, p in model.named_parameters()},
                "log_probs": log_probs.numpy(),
                "loss": float(sum(o["loss"] for o in outputs)),
                "entropy": float(sum(o["entropy"] for o in outputs)),
                "padded_tokens": sum(mb.padded_tokens for mb in mbs),
            }
        finally:
            rank.shutdown()

    return ray.get(run.remote(cfg, str(checkpoint), rb))


def by_sample(rb: RankBatch, per_token: np.ndarray) -> dict[int, np.ndarray]:
    """Per-response-token values of ``rb`` (row order) keyed by each row's sample index."""
    off = rb.response_offsets()
    return {int(s): per_token[off[i] : off[i + 1]] for i, s in enumerate(rb.sample_indices)}
