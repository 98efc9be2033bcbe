"""The trainer's log-probs and entropy are those of logits / rollout_temperature (as the engines
report them in vLLM's ``processed_logprobs`` mode), at TP 1 and through the vocab-parallel path
at TP 2. Real Megatron ranks as Ray actors; the reference is the HF model in this process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from vime_trainer.megatron.actor_group import ActorGroup

from tests.support.megatron import Publisher, rollout_batch, run_config, split
from vime.batch import RankBatch

TEMPERATURE = 0.7


def hf_response_stats(
    checkpoint: Path, rb: RankBatch, temperature: float
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sample of ``rb`` (row order): log p(response token) and entropy under HF logits / T."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), attn_implementation="sdpa")
    out = []
    with torch.no_grad():
        for i in range(rb.num_samples):
            s = rb.sample(i)
            p, r = s.prompt_length, s.response_length
            ids = torch.as_tensor(s.tokens, dtype=torch.long)[None]
            logp = torch.log_softmax(model(ids).logits[0, p - 1 : p - 1 + r].float() / temperature, dim=-1)
            lp = logp.gather(-1, ids[0, p:].unsqueeze(-1)).squeeze(-1)
            out.append((lp.numpy(), (-(logp.exp() * logp).sum(-1)).numpy()))
    return out


def sample_mean_of_token_means(values: list[np.ndarray], rb: RankBatch) -> float:
    """The loss's aggregation: per-sample mean over the loss mask, averaged over the samples."""
    means = [
        float((v * m).sum() / m.sum())
        for v, m in zip(values, (rb.sample(i).loss_mask for i in range(rb.num_samples)), strict=True)
    ]
    return sum(means) / len(means)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_log_probs_and_entropy_are_of_logits_over_the_rollout_temperature(
    ray_cluster: None, qwen3: Path, publish: Publisher, tmp_path: Path, tp: int
) -> None:
    cfg = run_config(tmp_path, tp=tp, ranks=tp, rollout_temperature=TEMPERATURE)
    (rb,) = split(cfg, rollout_batch(cfg, 0, seed=11))
    group = ActorGroup(cfg, str(qwen3))
    group.start()
    try:
        got = np.concatenate(group.call("log_probs", rb)[0])  # every TP rank of the last stage answers
        (step,) = group.train(publish([rb])).steps
    finally:
        group.shutdown()
    tempered = hf_response_stats(qwen3, rb, TEMPERATURE)
    plain = np.concatenate([lp for lp, _ in hf_response_stats(qwen3, rb, 1.0)])
    want = np.concatenate([lp for lp, _ in tempered])
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
    assert np.abs(plain - want).max() > 0.05  # temperature 1 would have failed the check above
    entropy = sample_mean_of_token_means([ent for _, ent in tempered], rb)
    assert step["entropy"] == pytest.approx(entropy, rel=1e-4)
    assert step["ppo_kl"] == 0.0 and step["step_ok"] == 1.0  # old = current at T: ratio 1
