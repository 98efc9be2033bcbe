"""The batch builder (seed steps 30–31) with the seed's own numbers: ±0.9354, num_microbatches=[8]."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from vime_rollout.batch_builder import BatchBuildError, build_batch, order_groups

from vime.config import RunConfig, load_config
from vime.types import Sample, SampleStatus

SEED_GROUP_0 = [1, 0, 0, 1, 1, 0, 1, 0]


def _groups(
    n_groups: int, n: int, rewards: list[list[float]] | None = None, seed: int = 0
) -> list[list[Sample]]:
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        group = []
        prompt = [rng.randrange(100) for _ in range(rng.randint(5, 40))]
        for k in range(n):
            s = Sample(tokens=list(prompt), group_index=g, index=g * n + k)
            length = rng.randint(1, 60)
            s.append_response_tokens([rng.randrange(100) for _ in range(length)])
            s.status = SampleStatus.TRUNCATED if length == 60 else SampleStatus.COMPLETED
            s.reward = rewards[g][k] if rewards else float(rng.random() < 0.5)
            s.weight_version = "1"
            group.append(s)
        groups.append(group)
    return groups


def _seed_cfg(**over: Any) -> RunConfig:
    # The seed scenario: 32 prompts × 8, global batch 256, micro-batch 8, TP 2 on 8 GPUs → DP 4.
    return load_config(overrides=[f"{k}={v}" for k, v in over.items()])


def test_seed_scenario_advantages_and_schedule() -> None:
    cfg = _seed_cfg()
    assert (cfg.global_batch_size, cfg.dp_size, cfg.micro_batch_size) == (256, 4, 8)
    rewards = [SEED_GROUP_0] + [[float((g + k) % 3 == 0) for k in range(8)] for g in range(1, 32)]
    groups = _groups(32, 8, rewards)
    random.Random(1).shuffle(groups)  # groups finish in any order
    built = build_batch(
        cfg, groups, batch_id="r:0:0", run_id="r", rollout_id=0, weight_version=1, dp_size=cfg.dp_size
    )
    b = built.batch
    assert b.num_samples == 256
    assert b.group_indices.tolist() == [i // 8 for i in range(256)]
    assert b.sample_indices.tolist() == list(range(256))
    np.testing.assert_allclose(
        b.advantages[:8], [0.9354, -0.9354, -0.9354, 0.9354, 0.9354, -0.9354, 0.9354, -0.9354], atol=1e-4
    )
    np.testing.assert_array_equal(b.rewards[:8], SEED_GROUP_0)
    # Every group is centred.
    assert np.allclose(b.advantages.reshape(32, 8).sum(axis=1), 0, atol=1e-5)
    assert int(b.loss_masks.sum()) == int(b.response_lengths.sum()) == len(b.loss_masks)
    assert not b.has_rollout_log_probs.any() and np.isnan(b.rollout_log_probs).all()
    assert (b.weight_versions == 1).all() and b.weight_version == 1
    assert len(built.shares) == 4
    for rank, share in enumerate(built.shares):
        assert share.dp_rank == rank and share.num_samples == 64
        assert share.num_microbatches == [8] and len(share.micro_batches) == 8
        assert all(end - start == 8 for start, end in share.micro_batches)
    everyone = sorted(int(i) for sh in built.shares for i in sh.sample_indices)
    assert everyone == list(range(256))
    # Balanced by tokens: the ranks' totals are close.
    totals = [int(sh.total_lengths().sum()) for sh in built.shares]
    assert max(totals) - min(totals) <= max(int(x) for x in b.total_lengths())


def test_four_steps_per_rollout() -> None:
    cfg = _seed_cfg(num_steps_per_rollout=4)
    built = build_batch(
        cfg, _groups(32, 8), batch_id="r:0:0", run_id="r", rollout_id=0, weight_version=1, dp_size=4
    )
    assert cfg.global_batch_size == 64
    assert all(sh.num_microbatches == [2, 2, 2, 2] for sh in built.shares)


def test_all_equal_group_gives_zero_advantage_and_is_counted() -> None:
    cfg = _seed_cfg(rollout_batch_size=4, micro_batch_size=2)
    rewards = [[1.0] * 8, SEED_GROUP_0, [0.0] * 8, SEED_GROUP_0]
    built = build_batch(
        cfg, _groups(4, 8, rewards), batch_id="x", run_id="r", rollout_id=3, weight_version=2, dp_size=4
    )
    assert np.all(built.batch.advantages[:8] == 0) and np.all(built.batch.advantages[16:24] == 0)
    assert built.batch.metrics["rollout/zero_advantage_groups"] == 2.0


def test_std_normalisation_off_only_centres() -> None:
    cfg = _seed_cfg(rollout_batch_size=4, micro_batch_size=2, grpo_std_normalization=False)
    built = build_batch(
        cfg,
        _groups(4, 8, [SEED_GROUP_0] * 4),
        batch_id="x",
        run_id="r",
        rollout_id=0,
        weight_version=1,
        dp_size=4,
    )
    np.testing.assert_allclose(built.batch.advantages[:8], [0.5, -0.5, -0.5, 0.5, 0.5, -0.5, 0.5, -0.5])


def test_log_probs_travel_only_where_requested() -> None:
    cfg = _seed_cfg(rollout_batch_size=4, micro_batch_size=2)
    groups = _groups(4, 8)
    for s in groups[1]:
        s.rollout_log_probs = [-0.25] * s.response_length
    b = build_batch(cfg, groups, batch_id="x", run_id="r", rollout_id=0, weight_version=1, dp_size=4).batch
    assert b.has_rollout_log_probs.tolist() == [False] * 8 + [True] * 8 + [False] * 16
    roff = b.response_offsets()
    assert np.all(b.rollout_log_probs[roff[8] : roff[16]] == -0.25)
    assert np.isnan(b.rollout_log_probs[: roff[8]]).all()


def test_bad_groups_are_refused() -> None:
    cfg = _seed_cfg(rollout_batch_size=4, micro_batch_size=2)
    groups = _groups(4, 8)
    with pytest.raises(BatchBuildError, match="has 7 samples"):
        order_groups([*groups[:3], groups[3][:7]], 8)
    groups[2][3].reward = None
    with pytest.raises(BatchBuildError, match="without a reward"):
        build_batch(cfg, groups, batch_id="x", run_id="r", rollout_id=0, weight_version=1, dp_size=4)
    with pytest.raises(BatchBuildError, match="dp_size=3"):
        build_batch(cfg, _groups(4, 8), batch_id="x", run_id="r", rollout_id=0, weight_version=1, dp_size=3)
