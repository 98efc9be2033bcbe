"""Training settings the step applies: one parameter dtype, the warm-up's own learning rate."""

from __future__ import annotations

import torch
from vime_trainer.megatron.model import one_param_dtype


def test_norm_weights_follow_the_training_dtype_and_keep_their_identity() -> None:
    # torch.nn.RMSNorm (Megatron's norm without Apex/TE) ignores params_dtype: its weight is fp32.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.bfloat16), torch.nn.RMSNorm(4))
    before = [id(p) for p in model.parameters()]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16, torch.float32}
    one_param_dtype(model, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert [id(p) for p in model.parameters()] == before  # the optimizer's references stay valid
    out = model(torch.ones(2, 4, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def test_the_warm_up_trains_at_its_own_learning_rate_then_restores_the_rl_one() -> None:
    from types import SimpleNamespace

    from vime_trainer.megatron.train_step import TrainStep

    step = object.__new__(TrainStep)
    groups = [{"lr": 1e-4}, {"lr": 1e-4}]
    step.passes = SimpleNamespace(optimizer=SimpleNamespace(param_groups=groups))  # type: ignore[assignment]
    with step._learning_rate(1e-3):
        assert [g["lr"] for g in groups] == [1e-3, 1e-3]
    assert [g["lr"] for g in groups] == [1e-4, 1e-4]
    try:
        with step._learning_rate(1e-3):
            raise RuntimeError("a failed step")
    except RuntimeError:
        pass
    assert [g["lr"] for g in groups] == [1e-4, 1e-4]
    with step._learning_rate(None):
        assert [g["lr"] for g in groups] == [1e-4, 1e-4]
