"""`Offloader`: a sleep/wake cycle frees every storage and brings the training state back exactly.

The mixed-precision optimizer here is a stand-in with the part of Megatron's
``Float16OptimizerWithFloat16Params`` the offloader reads (``float16_groups``,
``fp32_from_float16_groups``, ``_copy_main_params_to_model_params``; Megatron's class refuses CPU
tensors); tests/gpu/test_megatron_gpu.py runs the real one on the GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from vime_trainer.megatron.memory import Offloader, masters_of


class MixedPrecision:
    """bf16 model parameters stepped through fp32 masters by AdamW, rounded back after each step."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.float16_groups = [params]
        self.fp32_from_float16_groups = [[p.detach().float().clone() for p in params]]
        self.optimizer = torch.optim.AdamW(self.fp32_from_float16_groups[0], lr=0.05)

    def step(self) -> None:
        for p, main in zip(self.float16_groups[0], self.fp32_from_float16_groups[0], strict=True):
            main.grad = p.grad.float()
            p.grad = None
        self.optimizer.step()
        self._copy_main_params_to_model_params()

    def _copy_main_params_to_model_params(self) -> None:
        for p, main in zip(self.float16_groups[0], self.fp32_from_float16_groups[0], strict=True):
            p.data.copy_(main)


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def _train(model: torch.nn.Module, opt: MixedPrecision | torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).dtype)
    model(x).float().square().mean().backward()
    opt.step()


def _snapshot(model: torch.nn.Module, opt: MixedPrecision) -> list[torch.Tensor]:
    masters = opt.fp32_from_float16_groups[0]
    state = [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [t.detach().clone() for t in (*model.parameters(), *masters, *state)]


def test_a_cycle_frees_everything_and_restores_masters_state_and_rounded_params() -> None:
    model = _model(torch.bfloat16)
    opt = MixedPrecision(list(model.parameters()))
    _train(model, opt, seed=1)
    before = _snapshot(model, opt)
    twin_model, twin_opt = copy.deepcopy(model), copy.deepcopy(opt)
    twin_opt.float16_groups = [list(twin_model.parameters())]
    offloader = Offloader(model, opt, "cpu")

    param_bytes = sum(p.numel() * 2 for p in model.parameters())
    master_grad_bytes = sum(m.grad.nbytes for m in opt.fp32_from_float16_groups[0])  # dropped, not copied
    freed = offloader.sleep()
    assert all(t.untyped_storage().nbytes() == 0 for t in _live(model, opt))
    # masters (fp32) and the two Adam moments (fp32) are copied; the bf16 parameters are not
    assert offloader.host_bytes == sum(b.nbytes for b in before[len(list(model.parameters())) :])
    assert freed == offloader.host_bytes + param_bytes + master_grad_bytes
    hosts = [h.data_ptr() for h in offloader._host]

    offloader.wake_up()
    after = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))

    # the state trains on exactly as if it had never slept; the second cycle reuses the buffer
    _train(model, opt, seed=2)
    _train(twin_model, twin_opt, seed=2)
    offloader.sleep()
    assert [h.data_ptr() for h in offloader._host] == hosts
    offloader.wake_up()
    assert all(
        torch.equal(a, b) for a, b in zip(_snapshot(model, opt), _snapshot(twin_model, twin_opt), strict=True)
    )


def test_parameters_without_masters_are_copied() -> None:
    """fp32 training (the CPU step): the optimizer steps the parameters themselves, so they are copied."""
    model = _model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train(model, opt, seed=1)
    assert masters_of(opt) == {}
    before = [p.detach().clone() for p in model.parameters()]
    offloader = Offloader(model, opt, "cpu")
    offloader.sleep()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    state_bytes = sum(v.nbytes for s in opt.state.values() for v in s.values())
    assert offloader.host_bytes == sum(b.nbytes for b in before) + state_bytes
    offloader.wake_up()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_one_parameter_without_a_master_keeps_every_parameter_copied() -> None:
    model = _model(torch.bfloat16)
    params = list(model.parameters())
    opt = MixedPrecision(params[:-1])  # the last bias is outside the mixed-precision groups
    with torch.no_grad():
        params[-1].add_(1.0)  # not the rounding of any master: it must come back from the copy
    before = [p.detach().clone() for p in params]
    offloader = Offloader(model, opt, "cpu")
    offloader.sleep()
    offloader.wake_up()
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))


def test_the_state_of_the_first_step_gets_one_more_buffer_and_nothing_is_wasted() -> None:
    """The trainer sleeps once before its first step (no Adam state yet), then after every step."""
    model = _model(torch.bfloat16)
    opt = MixedPrecision(list(model.parameters()))
    offloader = Offloader(model, opt, "cpu")
    offloader.sleep()
    offloader.wake_up()
    masters = offloader.host_bytes
    assert len(offloader._host) == 1 and masters == sum(m.nbytes for m in opt.fp32_from_float16_groups[0])
    _train(model, opt, seed=1)
    for _ in range(2):
        before = _snapshot(model, opt)
        offloader.sleep()
        offloader.wake_up()
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, opt), strict=True))
        state = sum(v.nbytes for s in opt.optimizer.state.values() for v in s.values())
        assert len(offloader._host) == 2 and offloader.host_bytes == masters + state


def test_without_offload_only_what_needs_no_copy_is_freed_and_training_goes_on_unchanged() -> None:
    """``offload_train=false``: masters and Adam state stay where they are, nothing is copied."""
    model = _model(torch.bfloat16)
    opt = MixedPrecision(list(model.parameters()))
    masters = opt.fp32_from_float16_groups[0]
    offloader = Offloader(model, opt, "cpu")
    _train(model, opt, seed=1)
    twin_model, twin_opt = copy.deepcopy(model), copy.deepcopy(opt)
    twin_opt.float16_groups = [list(twin_model.parameters())]
    state = [v for s in opt.optimizer.state.values() for v in s.values() if v.nbytes]
    resident = [(t.data_ptr(), t.detach().clone()) for t in (*masters, *state)]

    param_bytes = sum(p.nbytes for p in model.parameters())
    master_grad_bytes = sum(m.grad.nbytes for m in masters)
    assert offloader.sleep(offload=False) == param_bytes + master_grad_bytes
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(m.grad.untyped_storage().nbytes() == 0 for m in masters)
    assert offloader.host_bytes == 0
    for (ptr, value), t in zip(resident, (*masters, *state), strict=True):
        assert t.data_ptr() == ptr and torch.equal(t, value)  # in place, untouched
    offloader.wake_up()

    for seed in (2, 3):
        _train(model, opt, seed=seed)
        _train(twin_model, twin_opt, seed=seed)
    assert all(
        torch.equal(a, b) for a, b in zip(_snapshot(model, opt), _snapshot(twin_model, twin_opt), strict=True)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_sleep_keeping_weights_frees_them_only_when_dropped_and_wakes_the_same(dtype: torch.dtype) -> None:
    """The weight push reads the parameters on the device between the sleep and `drop_weights`;
    what the two calls free, copy and bring back together is what one full sleep does (bf16:
    rebuilt from masters; fp32 without masters: copied to the same host slices)."""
    runs = []
    for keep in (False, True):
        model = _model(dtype)
        opt: MixedPrecision | torch.optim.Optimizer = (
            MixedPrecision(list(model.parameters()))
            if dtype == torch.bfloat16
            else torch.optim.AdamW(model.parameters(), lr=0.05)
        )
        _train(model, opt, seed=1)
        params = [p.detach().clone() for p in model.parameters()]
        offloader = Offloader(model, opt, "cpu")
        freed = offloader.sleep(keep_weights=keep)
        if keep:
            assert offloader.asleep and offloader.weights_resident
            assert all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
            freed += offloader.drop_weights()
            assert offloader.drop_weights() == 0  # once
        assert not offloader.weights_resident
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        host = offloader.host_bytes
        offloader.wake_up()
        assert offloader.weights_resident
        model.zero_grad(
            set_to_none=True
        )  # the stand-in has no zero_grad_buffer (freed grads come back unset)
        _train(model, opt, seed=2)
        runs.append((freed, host, [p.detach().clone() for p in model.parameters()]))
    (freed, host, after), (kept_freed, kept_host, kept_after) = runs
    assert (kept_freed, kept_host) == (freed, host)
    assert all(torch.equal(a, b) for a, b in zip(after, kept_after, strict=True))


def test_a_wake_up_without_drop_frees_the_kept_weights_first() -> None:
    model = _model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train(model, opt, seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    offloader = Offloader(model, opt, "cpu")
    offloader.sleep(keep_weights=True)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # written while held: the copy taken at the drop has it
    offloader.wake_up()
    assert not offloader.asleep and offloader.drop_weights() == 0
    assert torch.equal(next(model.parameters()), before[0] + 1.0)
    assert all(torch.equal(a, p) for a, p in zip(before[1:], list(model.parameters())[1:], strict=True))


@pytest.mark.parametrize("awake_calls", ["wake_up", "sleep"])
def test_repeated_calls_are_no_ops(awake_calls: str) -> None:
    model = _model(torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    offloader = Offloader(model, opt, "cpu")
    if awake_calls == "wake_up":
        offloader.wake_up()
        assert not offloader.asleep and offloader.host_bytes == 0
    else:
        assert offloader.sleep() > 0
        assert offloader.sleep() == 0
        offloader.wake_up()
        assert not offloader.asleep


def _live(model: torch.nn.Module, opt: MixedPrecision) -> list[torch.Tensor]:
    state = [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [*model.parameters(), *opt.fp32_from_float16_groups[0], *state]
