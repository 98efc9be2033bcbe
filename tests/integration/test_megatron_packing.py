"""Packed micro-batches and token-budget micro-batches train exactly like the padded, fixed-size ones.

Real Megatron-core ranks on CPU (gloo, the CPU shim). Each side computes one optimizer step's
accumulated gradients from the same weights and the same samples; only the layout of the
micro-batches differs, so log-probs (per sample), the loss and every parameter's gradient must
agree to float tolerance. The end-to-end checks train packed, token-budget micro-batches on two
ranks (DP, TP or PP), with activation recomputation and the fused Adam step, against the HF +
AdamW reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vime_trainer.megatron.actor_group import ActorGroup

from tests.support.megatron import (
    Publisher,
    by_sample,
    hf_reference,
    rank_gradients,
    rollout_batch,
    run_config,
    split,
)
from vime.batch import RankBatch
from vime.config import RunConfig

ADVANTAGES = [0.9354, -0.5, 0.25, 1.0, -0.9354, 0.5, -0.25, 0.75]  # loss ≠ 0, every sample counts


def _step(tmp: Path, qwen3: Path, name: str, **top: Any) -> tuple[RankBatch, dict[str, Any]]:
    cfg: RunConfig = run_config(tmp / name, **top)
    (rb,) = split(cfg, rollout_batch(cfg, 0, ADVANTAGES, seed=4))
    return rb, rank_gradients(cfg, qwen3, rb)


def _assert_same_step(a: tuple[RankBatch, dict[str, Any]], b: tuple[RankBatch, dict[str, Any]]) -> None:
    (rb_a, got_a), (rb_b, got_b) = a, b
    lp_a, lp_b = by_sample(rb_a, got_a["log_probs"]), by_sample(rb_b, got_b["log_probs"])
    assert lp_a.keys() == lp_b.keys()
    for s in lp_a:
        np.testing.assert_allclose(lp_a[s], lp_b[s], rtol=1e-5, atol=1e-6)
    assert got_a["loss"] == pytest.approx(got_b["loss"], rel=1e-5, abs=1e-7)
    assert got_a["entropy"] == pytest.approx(got_b["entropy"], rel=1e-5)
    assert got_a["grads"].keys() == got_b["grads"].keys()
    scale = max(float(np.abs(g).max()) for g in got_a["grads"].values())
    assert scale > 0
    for name, g in got_a["grads"].items():
        np.testing.assert_allclose(g, got_b["grads"][name], rtol=1e-4, atol=1e-6 * scale, err_msg=name)


def test_packed_micro_batches_give_the_padded_gradients(
    ray_cluster: None, qwen3: Path, tmp_path: Path
) -> None:
    padded = _step(tmp_path, qwen3, "padded")
    packed = _step(tmp_path, qwen3, "packed", trainer={"packed_sequences": True})
    assert padded[0].micro_batches == packed[0].micro_batches  # same samples in each micro-batch
    assert packed[1]["padded_tokens"] == int(packed[0].total_lengths().sum())  # no padding left
    assert padded[1]["padded_tokens"] > packed[1]["padded_tokens"]
    _assert_same_step(padded, packed)


def test_token_budget_micro_batches_give_the_fixed_split_gradients(
    ray_cluster: None, qwen3: Path, tmp_path: Path
) -> None:
    fixed = _step(tmp_path, qwen3, "fixed", trainer={"packed_sequences": True})
    budget = _step(tmp_path, qwen3, "budget", max_tokens_per_gpu=30, trainer={"packed_sequences": True})
    assert fixed[0].num_microbatches == [4]
    lengths = budget[0].total_lengths()
    assert budget[0].num_microbatches[0] < 4  # fewer, fuller micro-batches
    assert all(lengths[a:b].sum() <= 30 for a, b in budget[0].micro_batches)
    _assert_same_step(fixed, budget)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "pp"), [pytest.param(1, 1, id="dp2"), pytest.param(2, 1, id="tp2"), pytest.param(1, 2, id="pp2")]
)
def test_packed_budget_steps_with_recompute_train_like_hf(
    ray_cluster: None, qwen3: Path, tmp_path: Path, tp: int, pp: int, publish: Publisher
) -> None:
    """Two ranks (DP, TP or PP), packed token-budget micro-batches: loss, grad norm, entropy of HF + AdamW."""
    trainer = {
        "lr": 1e-2,
        "clip_grad": 0.5,
        "packed_sequences": True,
        "recompute_activations": True,
    }
    cfg = run_config(tmp_path, tp=tp, pp=pp, ranks=2, max_tokens_per_gpu=24, trainer=trainer)
    batch = rollout_batch(cfg, 0, ADVANTAGES)
    reference = hf_reference(qwen3, batch, cfg, steps=2)
    group = ActorGroup(cfg, str(qwen3))
    group.start()
    try:
        rbs = split(cfg, batch)
        assert len(rbs) == cfg.dp_size and len({tuple(rb.num_microbatches) for rb in rbs}) == 1
        got = []
        for r in range(2):
            for rb in rbs:
                rb.rollout_id = r
            got.append(group.train(publish(rbs)).steps[0])
    finally:
        group.shutdown()
    for step, ref in zip(got, reference, strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert step[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (key, step, ref)
