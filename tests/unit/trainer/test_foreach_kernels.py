"""The foreach replacements of Megatron's multi-tensor fallbacks give the fallbacks' results."""

from __future__ import annotations

import pytest
import torch
from megatron.core.optimizer import clip_grads, optimizer
from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale
from vime_trainer.megatron.optimizer import foreach_l2_norm, foreach_scale, use_foreach_kernels


def _tensors(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype) for shape in [(7, 5), (13,), (3, 4, 2), (1,)]]


def test_l2_norm_is_the_norm_over_every_element_of_every_tensor() -> None:
    tensors = _tensors(0)
    norm, per_tensor = foreach_l2_norm(2048 * 32, torch.zeros(1, dtype=torch.int), [tensors], False)
    expected = torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors]))
    assert per_tensor is None
    assert norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], expected)


def test_scale_by_one_copies_into_the_destination_dtype() -> None:
    src, dst = _tensors(1), [torch.zeros(t.shape, dtype=torch.bfloat16) for t in _tensors(1)]
    foreach_scale(0, torch.zeros(1), [src, dst], 1.0)
    for s, d in zip(src, dst, strict=True):
        assert d.dtype == torch.bfloat16
        assert torch.equal(d, s.to(torch.bfloat16))


@pytest.mark.parametrize("in_place", [True, False])
def test_scale_matches_megatrons_fallback(in_place: bool) -> None:
    ours, theirs = _tensors(2), _tensors(2)
    ours_dst = ours if in_place else [torch.empty_like(t) for t in ours]
    theirs_dst = theirs if in_place else [torch.empty_like(t) for t in theirs]
    foreach_scale(0, torch.zeros(1), [ours, ours_dst], 0.37)
    local_multi_tensor_scale(0, torch.zeros(1), [theirs, theirs_dst], 0.37)
    for a, b in zip(ours_dst, theirs_dst, strict=True):
        assert torch.equal(a, b)
    if not in_place:
        assert all(torch.equal(a, b) for a, b in zip(ours, _tensors(2), strict=True))  # sources untouched


def test_only_the_fallbacks_are_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", local_multi_tensor_scale)
    monkeypatch.setattr(optimizer, "multi_tensor_scale_impl", local_multi_tensor_scale)
    use_foreach_kernels()
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_scale
    assert optimizer.multi_tensor_scale_impl is foreach_scale

    def apex_kernel(*args: object) -> None: ...

    monkeypatch.setattr(clip_grads, "l2_norm_impl", apex_kernel)
    monkeypatch.setattr(optimizer, "multi_tensor_scale_impl", apex_kernel)
    use_foreach_kernels()
    assert clip_grads.l2_norm_impl is apex_kernel and optimizer.multi_tensor_scale_impl is apex_kernel
