"""Attention over packed samples equals causal attention over the same samples right-padded.

The padded reference is the SDPA module's own padded path (what training used before packing);
every packed kernel must give each sample the outputs and gradients it gets there. FlexAttention
has no CPU backward, and varlen is CUDA-only, so on CPU flex is checked forward-only.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from vime_trainer.megatron.micro_batch import PackedSamples
from vime_trainer.megatron.sdpa import SDPAttention, resolve_packed_kernel

LENGTHS = [5, 1, 9, 3]
HEADS, GROUPS, DIM = 4, 2, 64


def _module(kernel: str = "segments") -> SDPAttention:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DIM,
        attention_dropout=0.0,
    )
    return SDPAttention(config, 1, AttnMaskType.causal, packed_kernel=kernel)  # type: ignore[arg-type]


def _packing(device: str = "cpu") -> PackedSamples:
    bounds = [0]
    for n in LENGTHS:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    m = max(LENGTHS)
    return PackedSamples(
        qkv_format="sbhd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=m,
        max_seqlen_kv=m,
        bounds=tuple(bounds),
    )


def _qkv(device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    shapes = [(total, 1, HEADS, DIM), (total, 1, GROUPS, DIM), (total, 1, GROUPS, DIM)]
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_() for s in shapes]


def _padded(module: SDPAttention, qkv: list[torch.Tensor]) -> torch.Tensor:
    """Each sample right-padded into [s, b, heads, d], through the padded path, packed back."""
    s, starts = max(LENGTHS), [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    padded = []
    for t in qkv:
        x = t.new_zeros(s, len(LENGTHS), *t.shape[2:])
        for j, (a, n) in enumerate(zip(starts, LENGTHS, strict=True)):
            x[:n, j] = t[a : a + n, 0]
        padded.append(x)
    out = module(*padded, None)  # [s, b, heads·d]
    return torch.cat([out[:n, j] for j, n in enumerate(LENGTHS)]).unsqueeze(1)


def _grads(out: torch.Tensor, qkv: list[torch.Tensor]) -> list[torch.Tensor]:
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    return list(torch.autograd.grad((out.float() * weights).sum(), qkv))


def test_segments_kernel_equals_padded_attention_with_gradients() -> None:
    module, qkv = _module("segments"), _qkv()
    packed = module(*qkv, None, packed_seq_params=_packing())
    reference = _padded(module, qkv)
    assert packed.shape == (sum(LENGTHS), 1, HEADS * DIM)
    torch.testing.assert_close(packed, reference, rtol=1e-6, atol=1e-6)
    for got, want in zip(_grads(packed, qkv), _grads(reference, qkv), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_sample_never_sees_the_previous_one() -> None:
    module, qkv = _module("segments"), _qkv()
    out = module(*qkv, None, packed_seq_params=_packing())
    changed = [t.detach().clone() for t in qkv]
    changed[2][: LENGTHS[0]] += 5.0  # new values for sample 0 only
    again = module(*changed, None, packed_seq_params=_packing())
    assert not torch.allclose(out[: LENGTHS[0]], again[: LENGTHS[0]])
    torch.testing.assert_close(out[LENGTHS[0] :], again[LENGTHS[0] :], rtol=0, atol=0)


def test_flex_kernel_forward_equals_segments() -> None:
    module = _module("flex")
    qkv = [t.detach() for t in _qkv()]
    with torch.no_grad():
        got = module(*qkv, None, packed_seq_params=_packing())
        want = _module("segments")(*qkv, None, packed_seq_params=_packing())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen and flex training kernels need CUDA")
@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_gpu_kernels_equal_padded_attention_in_bf16(kernel: str) -> None:
    module, qkv = _module(kernel).cuda(), _qkv("cuda", torch.bfloat16)
    packed = module(*qkv, None, packed_seq_params=_packing("cuda"))
    reference = _padded(module, qkv)
    torch.testing.assert_close(packed, reference, rtol=2e-2, atol=2e-2)
    for got, want in zip(_grads(packed, qkv), _grads(reference, qkv), strict=True):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


def test_kernel_choice() -> None:
    assert resolve_packed_kernel("auto", on_gpu=False) == "segments"
    assert resolve_packed_kernel("auto", on_gpu=True) == "varlen"
    assert resolve_packed_kernel("flex", on_gpu=True) == "flex"
    with pytest.raises(ValueError, match="needs a GPU"):
        resolve_packed_kernel("varlen", on_gpu=False)
    with pytest.raises(ValueError, match="choose auto"):
        resolve_packed_kernel("nested", on_gpu=True)
