"""The seed's worked numbers for the algorithms (steps 8, 30, 31, 38, 39, 40, 45)."""

from __future__ import annotations

import math

import pytest
import torch

from vime.algorithms import (
    build_dp_schedule,
    can_reuse_log_probs_in_loss,
    compute_policy_loss,
    get_grpo_returns,
    masked_mean,
    normalize_group_rewards,
    sample_mean_of_token_means,
    should_flush_cache,
)
from vime.config import load_config

SEED_REWARDS = [1, 0, 0, 1, 1, 0, 1, 0]


def test_group_normalisation_seed_step_30() -> None:
    adv = normalize_group_rewards(SEED_REWARDS, 8)
    expected = 0.5 / (math.sqrt(8 * 0.25 / 7) + 1e-6)
    assert [round(a, 4) for a in adv] == [0.9354, -0.9354, -0.9354, 0.9354, 0.9354, -0.9354, 0.9354, -0.9354]
    assert adv[0] == pytest.approx(expected, abs=1e-12)
    # torch.std (unbiased) agrees
    t = torch.tensor(SEED_REWARDS, dtype=torch.float64)
    ref = (t - t.mean()) / (t.std() + 1e-6)
    assert adv == pytest.approx(ref.tolist(), abs=1e-12)


def test_equal_rewards_give_zeros_and_groups_are_independent() -> None:
    adv = normalize_group_rewards([1] * 8 + SEED_REWARDS, 8)
    assert adv[:8] == [0.0] * 8
    assert round(adv[8], 4) == 0.9354


def test_normalisation_without_std_and_single_member_groups() -> None:
    assert normalize_group_rewards([1, 0], 2, std_normalization=False) == [0.5, -0.5]
    assert normalize_group_rewards([3.0, 5.0], 1) == [0.0, 0.0]
    with pytest.raises(ValueError, match="whole groups"):
        normalize_group_rewards([1, 0, 1], 2)


def test_grpo_returns_seed_step_39() -> None:
    returns = get_grpo_returns([0.9354, -0.9354], [3, 2])
    assert returns == [[0.9354] * 3, [-0.9354] * 2]
    with pytest.raises(ValueError):
        get_grpo_returns([1.0], [1, 2])


def test_policy_loss_at_ratio_one_seed_step_40() -> None:
    log_probs = torch.tensor([-0.7, -1.2], requires_grad=True)
    old = log_probs.detach()
    adv = torch.tensor([0.9354, -0.9354])
    loss, clipfrac = compute_policy_loss(old - log_probs, adv, 0.2, 0.2)
    assert loss.tolist() == pytest.approx([-0.9354, 0.9354])
    assert clipfrac.tolist() == [0.0, 0.0]
    loss.sum().backward()
    # Non-zero gradient at ratio 1: d(-exp(lp - old)·A)/d lp = -A.
    assert log_probs.grad is not None
    assert log_probs.grad.tolist() == pytest.approx([-0.9354, 0.9354])


def test_clipped_ratio_has_zero_gradient() -> None:
    # The policy already moved: ratio 1.5 > 1 + 0.2 with A > 0 and ratio 0.5 < 0.8 with A < 0.
    old = torch.log(torch.tensor([0.2, 0.4]))
    log_probs = torch.log(torch.tensor([0.3, 0.2])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    loss, clipfrac = compute_policy_loss(old - log_probs, adv, 0.2, 0.2)
    assert loss.tolist() == pytest.approx([-1.2, 0.8])
    assert clipfrac.tolist() == [1.0, 1.0]
    loss.sum().backward()
    assert log_probs.grad is not None
    assert log_probs.grad.tolist() == [0.0, 0.0]


def test_asymmetric_and_dual_clip() -> None:
    ppo_kl = -torch.log(torch.tensor([1.25, 4.0]))  # ratios 1.25 and 4.0
    adv = torch.tensor([1.0, -1.0])
    loss, _ = compute_policy_loss(ppo_kl, adv, 0.2, 0.28)
    assert loss.tolist() == pytest.approx([-1.25, 4.0])  # 1.25 < 1.28: not clipped; A<0 takes max(-r·A, ...)
    dual, _ = compute_policy_loss(ppo_kl, adv, 0.2, 0.28, eps_clip_c=3.0)
    assert dual.tolist() == pytest.approx([-1.25, 3.0])  # capped at eps_clip_c·|A| for A < 0
    with pytest.raises(ValueError):
        compute_policy_loss(ppo_kl, adv, 0.2, 0.2, eps_clip_c=0.5)


def test_masked_aggregation() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0])
    mask = torch.tensor([1, 1, 0, 1, 0])
    assert masked_mean(values, mask).item() == pytest.approx(13 / 3)
    # per sample: [1,2,(3)] -> 1.5 ; [10,(20)] -> 10 ; mean = 5.75
    assert sample_mean_of_token_means(values, mask, [3, 2]).item() == pytest.approx(5.75)
    assert sample_mean_of_token_means(values, mask, [3, 2], num_samples=4).item() == pytest.approx(11.5 / 4)
    with pytest.raises(ValueError):
        sample_mean_of_token_means(values, mask, [3, 3])


def test_sample_mean_has_the_gradient_of_the_per_sample_loop() -> None:
    lengths = [4, 1, 3, 2]
    values = torch.randn(10, generator=torch.Generator().manual_seed(0), requires_grad=True)
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 0, 0])  # sample 1 and sample 3 fully masked
    got = sample_mean_of_token_means(values, mask, lengths, num_samples=8)
    loop = sum(masked_mean(v, m) for v, m in zip(values.split(lengths), mask.split(lengths), strict=True)) / 8
    torch.testing.assert_close(got, loop)
    index = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2, 3, 3])
    torch.testing.assert_close(sample_mean_of_token_means(values, mask, lengths, 8, sample_index=index), got)
    torch.testing.assert_close(torch.autograd.grad(got, values)[0], torch.autograd.grad(loop, values)[0])


def test_dp_schedule_seed_scenario() -> None:
    lengths = [200 + (i * 37) % 1024 for i in range(256)]
    sched = build_dp_schedule(lengths, global_batch_size=256, micro_batch_size=8, dp_size=4)
    assert sched.num_microbatches == [8]
    assert sched.global_batch_sizes == [256]
    assert [len(p) for p in sched.partitions] == [64] * 4
    assert all(len(mbs) == 8 and all(len(mb) == 8 for mb in mbs) for mbs in sched.micro_batch_indices)
    assert sorted(i for p in sched.partitions for i in p) == list(range(256))
    tokens = sched.rank_tokens(lengths)
    assert max(tokens) - min(tokens) <= max(lengths)  # balanced to within one sample


def test_dp_schedule_four_steps() -> None:
    lengths = list(range(1, 257))
    sched = build_dp_schedule(lengths, global_batch_size=64, micro_batch_size=8, dp_size=4)
    assert sched.num_microbatches == [2, 2, 2, 2]
    # step s trains only on samples of step s, in order of steps
    for part in sched.partitions:
        steps = [i // 64 for i in part]
        assert steps == sorted(steps) and len(part) == 64


def test_dp_schedule_balances_better_than_contiguous_split() -> None:
    lengths = [4000] * 8 + [10] * 24
    sched = build_dp_schedule(lengths, global_batch_size=32, micro_batch_size=2, dp_size=4)
    balanced = sched.rank_tokens(lengths)
    contiguous = [sum(lengths[r * 8 : (r + 1) * 8]) for r in range(4)]
    assert max(balanced) < max(contiguous)
    assert max(balanced) - min(balanced) == 0


def _tokens(sched: object, lengths: list[int]) -> list[list[int]]:
    return [[sum(lengths[i] for i in mb) for mb in mbs] for mbs in sched.micro_batch_indices]  # type: ignore[attr-defined]


def test_token_budget_cuts_micro_batches_by_tokens() -> None:
    lengths = [200 + (i * 37) % 1024 for i in range(256)]  # 200..1223 tokens, seed scenario sizes
    sched = build_dp_schedule(lengths, 256, micro_batch_size=8, dp_size=4, max_tokens_per_gpu=4096)
    (k,) = sched.num_microbatches
    assert all(len(mbs) == k for mbs in sched.micro_batch_indices)  # every rank runs k micro-batches
    assert all(t <= 4096 for rank in _tokens(sched, lengths) for t in rank)
    assert k == max(-(-t // 4096) for t in sched.rank_tokens(lengths))  # as few as the budget allows
    # the rank split is the fixed schedule's: same samples per rank, balanced tokens
    fixed = build_dp_schedule(lengths, 256, micro_batch_size=8, dp_size=4)
    assert [sorted(p) for p in sched.partitions] == [sorted(p) for p in fixed.partitions]
    for part, mbs in zip(sched.partitions, sched.micro_batch_indices, strict=True):
        assert [i for mb in mbs for i in mb] == part  # micro-batches list the partition in order


def test_token_budget_keeps_steps_and_puts_a_long_sample_alone() -> None:
    lengths = [30] + [5] * 15 + [12] * 16
    sched = build_dp_schedule(lengths, 16, micro_batch_size=1, dp_size=2, max_tokens_per_gpu=20)
    assert len(sched.num_microbatches) == 2 and sched.global_batch_sizes == [16, 16]
    for part in sched.partitions:
        assert [i // 16 for i in part] == sorted(i // 16 for i in part)  # step 0's samples first
    tokens = _tokens(sched, lengths)
    over = [(r, k) for r, rank in enumerate(tokens) for k, t in enumerate(rank) if t > 20]
    assert [len(sched.micro_batch_indices[r][k]) for r, k in over] == [1]  # only the 30-token sample
    assert sched.num_microbatches[1] == 8  # 12-token samples: one per micro-batch of 20


def test_without_a_budget_the_seed_numbers_stand() -> None:
    lengths = [200 + (i * 37) % 1024 for i in range(256)]
    assert build_dp_schedule(lengths, 256, 8, 4, max_tokens_per_gpu=None).num_microbatches == [8]
    assert build_dp_schedule(lengths, 64, 8, 4).num_microbatches == [2, 2, 2, 2]
    # with a budget only global_batch_size % dp_size matters, not the micro-batch size
    assert len(build_dp_schedule(lengths, 64, 48, 4, max_tokens_per_gpu=8192).num_microbatches) == 4
    with pytest.raises(ValueError, match="multiple of DP size = 3"):
        build_dp_schedule(lengths, 64, 8, 3, max_tokens_per_gpu=8192)
    with pytest.raises(ValueError, match="max_tokens_per_gpu=0"):
        build_dp_schedule(lengths, 64, 8, 4, max_tokens_per_gpu=0)


@pytest.mark.parametrize(
    ("n", "gbs", "mbs", "dp", "fragment"),
    [(250, 256, 8, 4, "whole steps"), (256, 256, 48, 4, "not a multiple"), (256, 0, 8, 4, ">= 1")],
)
def test_dp_schedule_refuses_bad_shapes(n: int, gbs: int, mbs: int, dp: int, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        build_dp_schedule([1] * n, gbs, mbs, dp)


def test_can_reuse_log_probs_seed_step_38() -> None:
    cfg = load_config()
    assert can_reuse_log_probs_in_loss(cfg, [8]) is True
    cfg4 = load_config(overrides=["num_steps_per_rollout=4"])
    assert can_reuse_log_probs_in_loss(cfg4, [2, 2, 2, 2]) is False
    for override in ["kl_coef=0.01", "use_rollout_logprobs=true", "get_mismatch_metrics=true"]:
        assert can_reuse_log_probs_in_loss(load_config(overrides=[override]), [8]) is False, override


def test_should_flush_cache_seed_steps_8_and_45() -> None:
    assert should_flush_cache(1, 1, 0) is True  # first push: 1 == 0 + 1
    assert should_flush_cache(1, 2, 0) is True  # (2 - 1) % 1 == 0
    flushes = [v for v in range(1, 8) if should_flush_cache(2, v, 0)]
    assert flushes == [1, 3, 5, 7]
    assert should_flush_cache(4, 6, 5) is True  # first push after a restart at version 5
    with pytest.raises(ValueError):
        should_flush_cache(0, 1, 0)
