"""The GPU step's fused RoPE, SwiGLU and RMSNorm give the unfused results, values and gradients.

On CPU the rotation itself (`fused.rotate`, uncompiled) is checked against Megatron's code in fp32
and the hook against the config's validation; on a GPU the compiled kernels are checked in bf16,
and the model's own forward with the fusions on against it with them off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.transformer_config import TransformerConfig
from vime_trainer.megatron.fused import (
    FusedRMSNorm,
    cos_sin,
    fused_rotary,
    rms_norm,
    rotate,
    use_fused_kernels,
)
from vime_trainer.megatron.logprobs import compiled_stats, local_stats

SEQ, BATCH, HEADS, DIM = 7, 2, 3, 16


def _angles(rot: int, device: str = "cpu") -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
    angles = torch.outer(torch.arange(SEQ, dtype=torch.float32, device=device), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]  # Megatron's [s, 1, 1, d_rot]


def _grad(fn, t: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    x = t.detach().clone().requires_grad_()
    out = fn(x, freqs)
    out.backward(torch.linspace(-1, 1, out.numel(), device=t.device).reshape(out.shape).to(out.dtype))
    assert x.grad is not None
    return out.detach(), x.grad


def rotary(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The uncompiled rotation at angles ``freqs``, with the cos/sin the fused path uses."""
    return rotate(t, *cos_sin(freqs))


def _megatron(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    return rope_utils._apply_rotary_pos_emb_bshd(t, freqs)


@pytest.mark.parametrize("rot", [DIM, DIM // 2])  # all channels rotated; half passed through
def test_rotary_equals_megatron_with_gradients(rot: int) -> None:
    t = torch.randn(SEQ, BATCH, HEADS, DIM)
    out, grad = _grad(rotary, t, _angles(rot))
    want, want_grad = _grad(_megatron, t, _angles(rot))
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(grad, want_grad)
    if rot < DIM:
        torch.testing.assert_close(out[..., rot:], t[..., rot:], rtol=0, atol=0)
    assert not torch.allclose(out, t)  # the rotation did something


def test_cos_sin_is_computed_once_per_frequency_tensor() -> None:
    freqs = _angles(DIM)
    first = cos_sin(freqs)
    assert cos_sin(freqs) is first  # every layer's query and key reuse it
    torch.testing.assert_close(first[0], freqs.cos(), rtol=0, atol=0)
    other = cos_sin(_angles(DIM) * 2)  # a new forward's tensor gets its own
    assert other is not first and not torch.allclose(other[1], first[1])


def test_hook_lets_the_config_turn_fusion_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    fields = dict(num_layers=1, hidden_size=64, num_attention_heads=4, activation_func=F.silu)
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        TransformerConfig(**fields, apply_rope_fusion=True)  # type: ignore[arg-type]
    config = TransformerConfig(**fields, gated_linear_unit=True, **use_fused_kernels())  # type: ignore[arg-type]
    assert config.apply_rope_fusion and config.bias_activation_fusion
    assert rope_utils.fused_apply_rotary_pos_emb is fused_rotary
    with pytest.raises(NotImplementedError):
        fused_rotary(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), interleaved=True)


def test_a_filled_hook_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    def other(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
        return t

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", other)
    use_fused_kernels()
    assert rope_utils.fused_apply_rotary_pos_emb is other


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels run on the GPU")
@pytest.mark.parametrize("seq", [SEQ, 3 * SEQ])  # a second length: one dynamic graph for both
def test_compiled_rotary_equals_megatron_in_bf16(seq: int) -> None:
    t = torch.randn(seq, 1, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    freqs = _angles(DIM, "cuda").repeat(3, 1, 1, 1)[:seq]
    out, grad = _grad(fused_rotary, t, freqs)
    want, want_grad = _grad(lambda x, f: rotary(x.float(), f), t.float(), freqs)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad.float(), want_grad, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels run on the GPU")
def test_fused_swiglu_equals_silu_product_in_bf16() -> None:
    y = torch.randn(SEQ, BATCH, 2 * DIM, device="cuda", dtype=torch.bfloat16)

    def unfused(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        a, b = x.float().chunk(2, dim=-1)
        return F.silu(a) * b

    out, grad = _grad(lambda x, _: bias_swiglu_impl(x, None), y, y)
    want, want_grad = _grad(unfused, y, y)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=2e-2, atol=2e-2)


def _stats_and_grads(fn, logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool):  # type: ignore[no-untyped-def]
    x = logits.detach().clone().requires_grad_()
    shift = x.detach().amax(-1).float() / 0.7
    outs = fn(x, shift, targets, 0.7, True, entropy_grad)
    sum(o.sum() * (k + 1) for k, o in enumerate(outs) if o.requires_grad).backward()
    assert x.grad is not None
    return [o.detach() for o in outs], x.grad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels run on the GPU")
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("rows", [5, 13])  # a second chunk length: the compiled graph is reused
def test_compiled_log_prob_stats_equal_eager_in_bf16(rows: int, entropy_grad: bool) -> None:
    logits = (torch.randn(rows, 1000, device="cuda") * 4).to(torch.bfloat16)
    targets = torch.randint(0, 1000, (rows,), device="cuda")
    targets[0] = -1  # the target lies in another TP rank's slice
    got, got_grad = _stats_and_grads(compiled_stats, logits, targets, entropy_grad)
    want, want_grad = _stats_and_grads(local_stats, logits, targets, entropy_grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert got[1][0] == 0  # nothing picked from another slice
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=1e-2, atol=1e-2)


def test_compiled_log_prob_stats_compile_once_for_every_chunk_length() -> None:
    """The first chunk length does not specialise the graph: a later, shorter chunk reuses it.

    Compiled for the CPU here (the GPU step's kernels come from the same graph); a recompile raises.
    """
    torch._dynamo.reset()
    for call, rows in enumerate((64, 37, 5)):
        logits = torch.randn(rows, 256) * 4
        targets = torch.randint(0, 256, (rows,))
        with torch._dynamo.config.patch(error_on_recompile=call > 0):
            got, got_grad = _stats_and_grads(compiled_stats, logits, targets, True)
        want, want_grad = _stats_and_grads(local_stats, logits, targets, True)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-4)


def test_a_steps_compiles_are_counted_recompiles_included() -> None:
    from vime_trainer.megatron.train_step import compiled_graphs

    fn = torch.compile(lambda x: (x * 2).sin(), backend="eager")
    before = compiled_graphs()
    fn(torch.randn(4))
    fn(torch.randn(4))
    assert compiled_graphs() == before + 1
    fn(torch.randn(4, 2))  # another rank: a recompile
    assert compiled_graphs() == before + 2


def _norm_grads(norm: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out = norm(x)
    out.backward(torch.linspace(-1, 1, out.numel(), device=x.device).reshape(out.shape).to(out.dtype))
    assert x.grad is not None and norm.weight.grad is not None
    grad_w = norm.weight.grad.clone()
    norm.weight.grad = None
    return out.detach(), x.grad, grad_w


class _Eager(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(weight.clone()), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def test_rms_norm_equals_torchs_with_gradients() -> None:
    torch.manual_seed(0)
    ref = torch.nn.RMSNorm(DIM, eps=1e-6)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    for shape in [(SEQ, 1, DIM), (SEQ, 1, HEADS, DIM)]:  # hidden states; per-head query / key
        x = torch.randn(*shape)
        want = _norm_grads(ref, x)
        got = _norm_grads(_Eager(ref.weight.detach(), 1e-6), x)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)


def test_fused_norm_replaces_every_norm_of_a_layer() -> None:
    from types import SimpleNamespace

    from vime_trainer.megatron.model import layer_spec

    arch: Any = SimpleNamespace(qk_layernorm=True)  # all layer_spec reads of the architecture
    plain = layer_spec(arch, use_sdpa=True).submodules
    fused = layer_spec(arch, use_sdpa=True, fused_norm=True).submodules
    attn = fused.self_attention.submodules
    norms = (fused.input_layernorm, fused.pre_mlp_layernorm, attn.q_layernorm, attn.k_layernorm)
    assert all(n is FusedRMSNorm for n in norms)
    assert plain.input_layernorm is not FusedRMSNorm


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels run on the GPU")
def test_compiled_rms_norm_equals_torchs_in_bf16() -> None:
    """Two widths (hidden size, head dim) and two lengths each: one graph per width, any length."""

    class Config:
        params_dtype = torch.bfloat16

    for width in (4 * DIM, DIM):
        ref = torch.nn.RMSNorm(width, eps=1e-6, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
        fused = FusedRMSNorm(Config(), width, eps=1e-6).cuda()
        with torch.no_grad():
            fused.weight.copy_(ref.weight)
        for seq in (SEQ, 3 * SEQ):
            x = torch.randn(seq, 1, HEADS, width, device="cuda", dtype=torch.bfloat16)
            got = _norm_grads(fused, x)
            want = _norm_grads(ref, x)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
