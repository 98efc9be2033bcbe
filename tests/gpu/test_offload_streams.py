"""The trainer's sleep/wake on GPU (skipped without CUDA): the optimizer state copied back on a side
stream is what the device reads once `Offloader.optimizer_ready` was called, even when the read is
queued right after the wake-up (the copy of ~1.6 GB takes tens of ms).

    bash scripts/gpu/device.sh run python3 -m pytest -x -q -m gpu tests/gpu/test_offload_streams.py
"""

from __future__ import annotations

import pytest
import torch
from vime_trainer.megatron.memory import Offloader, optimizer_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def test_the_optimizer_state_read_after_optimizer_ready_is_the_state_put_to_sleep() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, device="cuda") for _ in range(8)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model(torch.randn(64, 4096, device="cuda")).square().mean().backward()
    optimizer.step()
    state = list(optimizer_tensors(optimizer))
    expected = [t.clone() for t in state]
    params = [p.detach().clone() for p in model.parameters()]

    offloader = Offloader(model, optimizer, "cuda")
    for _ in range(2):  # the second cycle reuses the pinned buffers, as every step after the first
        assert offloader.sleep() > 0
        offloader.wake_up()
        offloader.optimizer_ready()
        assert all(torch.equal(t, e) for t, e in zip(state, expected, strict=True))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
