"""`init_adam_state`: Adam's state created before the first step trains exactly as torch's lazy state."""

from __future__ import annotations

import pytest
import torch
from vime_trainer.megatron.optimizer import init_adam_state


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((16, 8), (8,), (3, 4, 5))]


def _steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], n: int = 3) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_eager_state_trains_bit_for_bit_as_the_lazy_one(fused: bool, amsgrad: bool) -> None:
    lazy_params, eager_params = _params(), _params()
    kw = {
        "lr": 0.05,
        "weight_decay": 0.1,
        "fused": fused,
        "foreach": False if fused else None,
        "amsgrad": amsgrad,
    }
    lazy, eager = torch.optim.AdamW(lazy_params, **kw), torch.optim.AdamW(eager_params, **kw)
    init_adam_state(eager)
    assert all(eager.state[p]["exp_avg"].abs().sum() == 0 for p in eager_params)
    assert not lazy.state
    _steps(lazy, lazy_params, n=1)
    _steps(eager, eager_params, n=1)
    for a, b in zip(lazy_params, eager_params, strict=True):  # what the lazy first step created, the same
        sa, sb = lazy.state[a], eager.state[b]
        assert sorted(sa) == sorted(sb)
        for k in sa:
            assert (sa[k].dtype, sa[k].device, sa[k].shape) == (sb[k].dtype, sb[k].device, sb[k].shape), k
    _steps(lazy, lazy_params)
    _steps(eager, eager_params)
    for a, b in zip(lazy_params, eager_params, strict=True):
        assert torch.equal(a, b)
        assert all(torch.equal(lazy.state[a][k], eager.state[b][k]) for k in lazy.state[a])


def test_existing_state_is_left_alone() -> None:
    params = _params()
    opt = torch.optim.AdamW(params, lr=0.05, fused=True)
    _steps(opt, params, n=2)
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    init_adam_state(opt)
    assert all(torch.equal(before[k], v) for k, v in opt.state[params[0]].items())
