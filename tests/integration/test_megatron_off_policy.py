"""TIS and MIS on a real Megatron rank (CPU, gloo): the loss, the gradient norm and the mismatch
metrics of one step against an HF + AdamW reference with the weights written out by hand."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from vime_trainer.megatron.actor_group import ActorGroup

from tests.support.megatron import (
    Publisher,
    by_sample,
    hf_reference,
    rollout_batch,
    run_config,
    split,
    with_rollout_log_probs,
)

SHIFTS = np.array([0.0, 0.3, -0.3, 0.7, -0.7])
"""rollout log-prob = trainer log-prob + shift, cycled over the response tokens: ratios
exp(−shift) = 1, 0.741, 1.350, 0.497, 2.014."""
TIS_CLIP, MIS_LOW, MIS_HIGH = 1.2, 0.6, 1.6


def hand_weight(ratio: torch.Tensor) -> torch.Tensor:
    """min(ratio, 1.2), and 0 outside [0.6, 1.6]."""
    inside = (ratio >= MIS_LOW) & (ratio <= MIS_HIGH)
    return torch.where(inside, ratio.clamp(max=TIS_CLIP), torch.zeros_like(ratio))


def test_tis_and_mis_step_equals_a_hand_written_reference(
    ray_cluster: None, qwen3: Path, tmp_path: Path, publish: Publisher
) -> None:
    cfg = run_config(
        tmp_path,
        use_tis=True,
        tis_clip=TIS_CLIP,
        use_mis=True,
        mis_low=MIS_LOW,
        mis_high=MIS_HIGH,
        trainer={"lr": 1e-2, "clip_grad": 100.0},
    )
    batch = rollout_batch(cfg, 0, seed=11)
    (rb,) = split(cfg, batch)
    group = ActorGroup(cfg, str(qwen3))
    group.start()
    try:
        lps = np.concatenate(group.call("log_probs", rb)[0])
        shifts = np.resize(SHIFTS, len(lps))
        rollout = lps + shifts
        (step,) = group.train(publish([with_rollout_log_probs(rb, rollout)])).steps
    finally:
        group.shutdown()
    per_sample = by_sample(rb, rollout.astype(np.float32))

    def weights(index: int, lp: torch.Tensor) -> torch.Tensor:
        return hand_weight(torch.exp(lp - torch.as_tensor(per_sample[index])))

    (ref,) = hf_reference(qwen3, batch, cfg, steps=1, weights=weights)
    assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
    assert step["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    plain = hf_reference(qwen3, batch, cfg, steps=1)[0]
    assert abs(plain["grad_norm"] - ref["grad_norm"]) > 1e-3  # the weights changed the gradient

    counted = rb.loss_masks.astype(bool)
    ratios = np.exp(-shifts)[counted]
    assert step["mismatch_tokens"] == counted.sum()
    assert step["mismatch_ratio_mean"] == pytest.approx(ratios.mean(), rel=1e-4)
    assert step["mismatch_ratio_max"] == pytest.approx(ratios.max(), rel=1e-4)
    assert step["mismatch_tis_clipfrac"] == pytest.approx((ratios > TIS_CLIP).mean(), abs=1e-6)
    outside = (ratios < MIS_LOW) | (ratios > MIS_HIGH)
    assert step["mismatch_mis_maskfrac"] == pytest.approx(outside.mean(), abs=1e-6)
    assert step["mismatch_mean_abs"] == pytest.approx(np.abs(shifts)[counted].mean(), rel=1e-4)
    assert 0 < outside.mean() < 1 and math.isfinite(step["loss"])
