"""TIS / MIS weights (`vime.algorithms.off_policy`) against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from vime.algorithms import compute_policy_loss
from vime.algorithms.off_policy import LOG_RATIO_BOUND, Correction, importance_weights
from vime.config import ConfigError, load_config

NAN = float("nan")
# Four tokens of one sample: log-ratios +0.5, −1.0, 0.0, and one without a rollout log-prob.
TRAIN = torch.tensor([-1.0, -2.0, -0.5, -3.0])
ROLLOUT = torch.tensor([-1.5, -1.0, -0.5, NAN])
VALID = torch.tensor([True, True, True, False])
ONE_SAMPLE = torch.zeros(4, dtype=torch.long)


def weights(c: Correction, train: torch.Tensor = TRAIN, rollout: torch.Tensor = ROLLOUT) -> list[float]:
    return importance_weights(train, rollout, VALID, ONE_SAMPLE, 1, c).weight.tolist()


def test_ratio_and_what_tis_and_mis_would_do_when_off() -> None:
    w = importance_weights(
        TRAIN, ROLLOUT, VALID, ONE_SAMPLE, 1, Correction(tis_clip=1.5, mis_low=0.5, mis_high=1.5)
    )
    assert w.ratio.tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 1.0, 1.0])
    assert w.weight.tolist() == [1.0, 1.0, 1.0, 1.0]  # neither is on: the loss is unchanged
    assert w.clipped.tolist() == [True, False, False, False]  # e^0.5 = 1.6487 > 1.5
    assert w.masked.tolist() == [True, True, False, False]  # 1.6487 > 1.5, e^-1 = 0.3679 < 0.5


def test_tis_truncates_the_ratio_at_the_clip() -> None:
    got = weights(Correction(use_tis=True, tis_clip=1.5))
    assert got == pytest.approx([1.5, math.exp(-1.0), 1.0, 1.0])  # min(ratio, 1.5); 1 without a log-prob
    assert weights(Correction(use_tis=True, tis_clip=2.0)) == pytest.approx(
        [math.exp(0.5), math.exp(-1.0), 1.0, 1.0]
    )


def test_mis_drops_tokens_outside_the_band_and_keeps_tis_on_the_rest() -> None:
    band = {"mis_low": 0.5, "mis_high": 1.5}
    assert weights(Correction(use_mis=True, **band)) == [0.0, 0.0, 1.0, 1.0]
    assert weights(Correction(use_mis=True, mis_low=0.3, mis_high=1.7)) == [1.0, 1.0, 1.0, 1.0]
    both = weights(Correction(use_tis=True, tis_clip=1.2, use_mis=True, mis_low=0.3, mis_high=1.7))
    assert both == pytest.approx([1.2, math.exp(-1.0), 1.0, 1.0])


def test_mis_at_sample_level_uses_the_geometric_mean_of_a_samples_ratios() -> None:
    # Sample 0: log-ratios 0.5 and 0.3 (mean 0.4, ratio 1.4918); sample 1: 0.9 and 0.1 (mean 0.5,
    # ratio 1.6487). Band [0.5, 1.5]: sample 1 is dropped whole, although its second token alone
    # (ratio 1.105) lies in the band; sample 0 is kept whole, although its first token alone (1.6487)
    # does not.
    train = torch.tensor([0.5, 0.3, 0.9, 0.1]) - 2.0
    rollout = torch.full((4,), -2.0)
    valid = torch.ones(4, dtype=torch.bool)
    index = torch.tensor([0, 0, 1, 1])
    c = Correction(use_mis=True, mis_level="sample", mis_low=0.5, mis_high=1.5)
    w = importance_weights(train, rollout, valid, index, 2, c)
    assert w.weight.tolist() == [1.0, 1.0, 0.0, 0.0]
    token = importance_weights(
        train, rollout, valid, index, 2, Correction(use_mis=True, mis_low=0.5, mis_high=1.5)
    )
    assert token.weight.tolist() == [0.0, 1.0, 0.0, 1.0]  # token level: e^0.5 and e^0.9 leave it
    # A sample without any rollout log-prob is never dropped.
    none = importance_weights(train, rollout, torch.tensor([True, True, False, False]), index, 2, c)
    assert none.weight.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_the_weight_is_a_constant_of_the_loss() -> None:
    """d/d lp of −exp(lp − old)·A·w at ratio 1 is −A·w: the gradient is scaled by the weight,
    and none flows into it (the weight is built from detached log-probs)."""
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    rollout = torch.tensor([-1.5, -1.0, -0.5])
    adv = torch.tensor([0.9354, -0.9354, 0.9354])
    valid = torch.ones(3, dtype=torch.bool)
    w = importance_weights(
        lp, rollout, valid, torch.zeros(3, dtype=torch.long), 1, Correction(use_tis=True, tis_clip=1.5)
    )
    assert not w.weight.requires_grad
    pg, _ = compute_policy_loss(lp.detach() - lp, adv, 0.2, 0.2)
    (pg * w.weight).sum().backward()
    expected = [-0.9354 * 1.5, 0.9354 * math.exp(-1.0), -0.9354 * 1.0]
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx(expected)


def test_an_extreme_log_ratio_gives_a_finite_weight() -> None:
    train, rollout = torch.tensor([0.0, -500.0]), torch.tensor([-500.0, 0.0])
    valid = torch.ones(2, dtype=torch.bool)
    w = importance_weights(
        train, rollout, valid, torch.zeros(2, dtype=torch.long), 1, Correction(use_tis=True)
    )
    assert w.ratio.tolist() == pytest.approx([math.exp(LOG_RATIO_BOUND), math.exp(-LOG_RATIO_BOUND)])
    assert w.weight.tolist() == pytest.approx([2.0, math.exp(-LOG_RATIO_BOUND)])


def test_config_asks_for_rollout_log_probs_and_refuses_contradictions() -> None:
    assert load_config(overrides=["use_tis=true"]).rollout_logprobs_fraction == 1.0
    assert load_config(overrides=["use_mis=true"]).rollout_logprobs_fraction == 1.0
    assert Correction.of(load_config(overrides=["use_mis=true", "mis_level=sample"])).mis_level == "sample"
    with pytest.raises(ConfigError, match="unset one of them"):
        load_config(overrides=["use_tis=true", "use_rollout_logprobs=true"])
    with pytest.raises(ConfigError, match="must contain 1"):
        load_config(overrides=["use_mis=true", "mis_low=1.2", "mis_high=2.0"])
    with pytest.raises(ConfigError, match="tis_clip"):
        load_config(overrides=["tis_clip=0"])
