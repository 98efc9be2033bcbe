"""Every parameter of the policy model shares the training dtype (bf16 checkpoints depend on it)."""

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
