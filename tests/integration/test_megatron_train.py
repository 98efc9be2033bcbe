"""Megatron training ranks as Ray actors on CPU: HF logits, the seed's loss, layouts, KL, mismatch, SFT.

Real Megatron-core (gloo, the CPU shim) in Ray actors, a real HF checkpoint from the tiny-model
kit, batches published to a real Redis that every rank reads its share from (TP/PP peers the same
share); references are computed independently with transformers in this process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from vime_trainer.megatron.actor_group import ActorGroup, TrainerError
from vime_trainer.megatron.sft import sft_rank_batches
from vime_trainer.weights.hf_checkpoint import HFReader

from tests.support.megatron import (
    SEED_ADVANTAGE,
    Publisher,
    hf_logits,
    hf_reference,
    one,
    rollout_batch,
    run_config,
    split,
    with_rollout_log_probs,
)
from vime.models.tiny import vocabulary

TOKENS = np.random.default_rng(7).integers(0, 128, size=(2, 21))


@pytest.fixture(scope="module")
def tp1(ray_cluster: None, qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ActorGroup]:
    """One TP=1 rank shared by the tests whose checks do not depend on the current weights."""
    group = ActorGroup(run_config(tmp_path_factory.mktemp("tp1"), trainer={"lr": 1e-2}), str(qwen3))
    group.start()
    yield group
    group.shutdown()


def test_logits_equal_hf_exactly_at_tp1(tp1: ActorGroup, qwen3: Path) -> None:
    logits = one(tp1.call("logits", TOKENS))
    assert logits.shape == (2, 21, 128)
    assert np.abs(logits - hf_logits(qwen3, TOKENS)).max() == 0.0


def test_seed_loss_at_ratio_one(tp1: ActorGroup, publish: Publisher) -> None:
    """Seed step 40: old = current.detach(), ratio 1, per-token loss −A (∓0.9354), gradient non-zero."""
    cfg = tp1.config
    for rollout_id, sign in [(0, 1.0), (1, -1.0)]:
        batch = rollout_batch(cfg, rollout_id, [sign * SEED_ADVANTAGE] * 8, seed=rollout_id)
        t0 = time.perf_counter()
        result = tp1.train(publish(split(cfg, batch)))
        wall = time.perf_counter() - t0
        (step,) = result.steps
        parts = {k: v for k, v in step.items() if k.startswith("t_")}  # where the rank's time went
        assert set(parts) == {"t_read_s", "t_micro_batches_s", "t_passes_s", "t_backup_s"}
        assert all(v >= 0 for v in parts.values()) and parts["t_passes_s"] > 0
        assert sum(parts.values()) < wall
        assert step["compiled_graphs"] == 0.0  # the CPU step runs Megatron's unfused code
        (share,) = result.shares
        assert (share.dp_rank, share.samples, share.weight_versions) == (0, 8, (rollout_id + 1,))
        assert step["loss"] == pytest.approx(-sign * SEED_ADVANTAGE, abs=1e-6)
        assert step["pg_loss"] == pytest.approx(-sign * SEED_ADVANTAGE, abs=1e-6)
        assert step["ppo_kl"] == 0.0 and step["clipfrac"] == 0.0
        assert step["tokens"] == float(batch.loss_masks.sum())
        assert step["grad_norm"] > 0 and step["step_ok"] == 1.0
        assert step["entropy"] > 0
        assert "mismatch_mean_abs" not in step  # no sample carries rollout log-probs
    mixed = rollout_batch(cfg, 2)  # the seed's group: rewards [1,0,0,1,1,0,1,0]
    (step,) = tp1.train(publish(split(cfg, mixed))).steps
    assert step["pg_loss"] == pytest.approx(-float(np.mean(mixed.advantages)), abs=1e-6)


def test_mismatch_metrics_against_rollout_log_probs(tp1: ActorGroup, publish: Publisher) -> None:
    cfg = tp1.config
    (rb,) = split(cfg, rollout_batch(cfg, 3, seed=3))
    lps = np.concatenate(tp1.call("log_probs", rb)[0])
    assert lps.shape == (int(rb.response_lengths.sum()),) and (lps < 0).all()
    shifted = lps.copy()
    shifted[::4] -= 0.25  # a quarter of the tokens off by 0.25, the rest equal
    (step,) = tp1.train(publish([with_rollout_log_probs(rb, shifted)])).steps
    counted = rb.loss_masks.astype(bool)
    off = np.zeros_like(counted)
    off[::4] = True
    assert step["mismatch_tokens"] == counted.sum()
    assert step["mismatch_frac_above"] == pytest.approx((off & counted).sum() / counted.sum(), abs=1e-6)
    assert step["mismatch_mean_abs"] == pytest.approx(0.25 * (off & counted).sum() / counted.sum(), abs=1e-5)


def test_sft_warmup_learns_a_toy_arithmetic_task(tp1: ActorGroup, publish: Publisher) -> None:
    ids = {ch: i for i, ch in enumerate(vocabulary())}
    pairs = [
        (f"{a}+{b}=", f"{a + b}\n")
        for a, b in [(1, 2), (3, 4), (5, 2), (6, 1), (2, 2), (7, 1), (3, 3), (4, 4)]
    ]
    examples = [([ids[c] for c in p], [ids[c] for c in label]) for p, label in pairs]
    rbs = sft_rank_batches(examples, tp1.config)
    assert int(rbs[0].loss_masks.sum()) == sum(len(label) for _, label in examples)
    losses = [tp1.train_sft(publish(rbs)).steps[0]["loss"] for _ in range(10)]
    assert losses[0] == pytest.approx(np.log(128), rel=0.2)  # a random model starts near uniform
    assert losses[-1] < 0.5 * losses[0], losses
    with pytest.raises(ValueError, match="global_batch_size=8"):
        sft_rank_batches(examples[:3], tp1.config)


def test_bad_batches_are_refused_and_the_group_keeps_working(tp1: ActorGroup, publish: Publisher) -> None:
    cfg = tp1.config
    rbs = split(cfg, rollout_batch(cfg, 5, seed=5))
    ref = publish(rbs)
    with pytest.raises(TrainerError, match=r"holds rollout 5 .* asked for rollout 6"):
        tp1.train(replace(ref, rollout_id=6))
    with pytest.raises(TrainerError, match="split for DP size 2; asked for rollout 5 at DP size 1"):
        tp1.train(publish(split(cfg, rollout_batch(cfg, 5), dp_size=2)))
    tp1.sleep()
    with pytest.raises(TrainerError, match="asleep: wake it up first"):  # only the driver loop wakes it
        tp1.train(publish(rbs))
    tp1.wake_up()
    assert tp1.train(publish(rbs)).steps[0]["step_ok"] == 1.0


def test_missing_rollout_log_probs_fail_clearly(
    ray_cluster: None, qwen3: Path, tmp_path: Path, publish: Publisher
) -> None:
    cfg = run_config(tmp_path, use_rollout_logprobs=True)
    group = ActorGroup(cfg, str(qwen3))
    group.start()
    try:
        (rb,) = split(cfg, rollout_batch(cfg, 0))
        with pytest.raises(TrainerError, match="without rollout log-probs"):
            group.train(publish([rb]))
        lps = np.full(int(rb.response_lengths.sum()), -3.0, dtype=np.float32)
        (step,) = group.train(
            publish([with_rollout_log_probs(rb, lps)])
        ).steps  # old = rollout log-probs: ratio ≠ 1
        assert step["ppo_kl"] != 0.0 and step["step_ok"] == 1.0
    finally:
        group.shutdown()


def test_recomputed_old_log_probs_and_kl_term(
    ray_cluster: None, qwen3: Path, tmp_path: Path, publish: Publisher
) -> None:
    """num_microbatches [2, 2], kl_coef > 0: old log-probs come from a forward before step 0 (step 38)."""
    cfg = run_config(tmp_path, num_steps_per_rollout=2, kl_coef=0.1, trainer={"lr": 5e-2})
    group = ActorGroup(cfg, str(qwen3))
    group.start()
    try:
        rbs = split(cfg, rollout_batch(cfg, 0))
        assert rbs[0].num_microbatches == [2, 2]
        first, second = group.train(publish(rbs)).steps
        assert {"t_log_probs_s", "t_reference_log_probs_s"} <= set(first)  # the two no-grad passes
        assert not any(k.startswith("t_") for k in second)  # a rollout's parts are on its first step
        assert first["ppo_kl"] == 0.0 and first["clipfrac"] == 0.0  # same weights as the old log-probs
        assert first["kl_loss"] == 0.0  # the policy still equals the reference
        assert second["ppo_kl"] != 0.0 and second["kl_loss"] > 0.0  # step 0 moved the policy
        assert second["loss"] == pytest.approx(second["pg_loss"] + 0.1 * second["kl_loss"], abs=1e-6)
        again = group.train(publish(split(cfg, rollout_batch(cfg, 1)))).steps[0]
        assert again["kl_loss"] > 0.0 and again["ppo_kl"] == 0.0  # new rollout: old = current again
    finally:
        group.shutdown()


LAYOUTS = [
    pytest.param(1, 1, 1, id="tp1"),
    pytest.param(2, 1, 2, id="tp2"),
    pytest.param(1, 1, 2, id="dp2"),
    pytest.param(1, 2, 2, id="pp2"),
    pytest.param(2, 1, 4, id="tp2dp2"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "ranks"), LAYOUTS)
def test_layouts_match_an_hf_reference(
    ray_cluster: None, qwen3: Path, tmp_path: Path, publish: Publisher, tp: int, pp: int, ranks: int
) -> None:
    """TP=2, DP=2, PP=2 all train like HF + AdamW: same loss, grad norm and entropy over 2 rollouts;
    every rank reads its share from Redis (TP/PP peers by key), one summary per DP rank comes back."""
    cfg = run_config(tmp_path, tp=tp, pp=pp, ranks=ranks, trainer={"lr": 1e-2, "clip_grad": 0.5})
    batch = rollout_batch(cfg, 0)
    reference = hf_reference(qwen3, batch, cfg, steps=2)
    group = ActorGroup(cfg, str(qwen3))
    group.start()
    try:
        logits = one(group.call("logits", TOKENS))
        assert np.abs(logits - hf_logits(qwen3, TOKENS)).max() < 1e-5
        exported = one(group.call("hf_state_dict"))  # gathered over TP and PP
        results = [group.train(publish(split(cfg, rollout_batch(cfg, r, seed=0)))) for r in range(2)]
    finally:
        group.shutdown()
    got = [r.steps[0] for r in results]
    dp = ranks // (tp * pp)
    assert [(s.dp_rank, s.samples) for s in results[0].shares] == [(d, 8 // dp) for d in range(dp)]
    original = HFReader(qwen3).state_dict()
    assert exported.keys() == original.keys()
    assert all(np.array_equal(exported[k], v.numpy()) for k, v in original.items())
    for step, ref in zip(got, reference, strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert step[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (key, step, ref)
    assert reference[0]["grad_norm"] > 0.5  # so clipping really happened before step 1


def test_ranks_that_cannot_be_placed_fail_clearly(ray_cluster: None, qwen3: Path, tmp_path: Path) -> None:
    cfg = run_config(tmp_path, actor_num_gpus_per_node=1)  # a GPU rank on a cluster without GPUs
    group = ActorGroup(cfg, str(qwen3), placement_timeout_s=2)
    with pytest.raises(TrainerError, match="could not place 1 training ranks"):
        group.start()
    group.shutdown()  # nothing to stop, still fine
