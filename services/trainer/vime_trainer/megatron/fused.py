"""Fused RoPE, SwiGLU and RMSNorm for the GPU step, without TransformerEngine or Apex.

Megatron's unfused RoPE is about ten kernels per call on each of the query and the key (slices,
cos/sin, the rotate-half ``cat``, two products and a sum, the same again in backward), and its
unfused SwiGLU keeps three activations and runs ``silu`` and the product apart: together most of
the 635 ms of "norms, activations, RoPE, elementwise" in a 2.15 s Qwen3-4B step profiled on the
H200 (docs/benchmarks.md). Both fusions are Megatron's own switches: ``bias_activation_fusion``
selects its ``torch.compile``d SwiGLU (forward and backward one kernel each; only the input is
kept), and ``apply_rope_fusion`` calls ``rope_utils.fused_apply_rotary_pos_emb``, the hook
TransformerEngine's kernel fills when installed; `use_fused_kernels` fills it with `fused_rotary`,
compiled. `FusedRMSNorm` replaces ``torch.nn.RMSNorm`` (what Megatron's local spec builds without
Apex) in every layer: torch's kernels took 58 ms of a 505 ms Qwen3-0.6B step on the H100 (forward
21, input gradient 24, and a separate reduction for the weight's gradient 13), for ~17 ms of memory
traffic. The CPU step keeps Megatron's unfused code (no compiler needed in CI).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from megatron.core.models.common.embeddings import rope_utils


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``t`` ``[s, b, h, d]`` given ``cos``/``sin`` of its angles ``[s, 1, 1, d_rot]``, in fp32, rounded once.

    The same rotation as Megatron's ``_apply_rotary_pos_emb_bshd`` (halves, not interleaved; the
    ``d − d_rot`` trailing channels pass through), which rounds cos/sin and each product to
    ``t``'s dtype; TransformerEngine's kernel, like this one, computes in fp32.
    """
    rot = cos.shape[-1]
    x = t[..., :rot].float()
    x1, x2 = x.chunk(2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    if rot == t.shape[-1]:
        return out.to(t.dtype)
    return torch.cat((out.to(t.dtype), t[..., rot:]), dim=-1)


@cache
def _compiled_rotate() -> Any:
    # dynamic: one graph for every micro-batch length (packed budgets change it each step)
    return torch.compile(rotate, dynamic=True)


def cos_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of ``freqs``, computed on its first use and kept on the tensor itself.

    Megatron passes one frequency tensor per forward to every layer, for the query and the key
    alike: 2 × layers calls (72 on Qwen3-4B) share one cos/sin, which dies with the tensor. Evaluated
    in every call instead, the 4B step's RoPE kernels took 95 ms rather than 75 ms on the H200
    (docs/benchmarks.md).
    """
    kept: tuple[torch.Tensor, torch.Tensor] | None = getattr(freqs, "_vime_cos_sin", None)
    if kept is None:
        f = freqs.detach().float()
        kept = (f.cos(), f.sin())
        freqs._vime_cos_sin = kept  # type: ignore[attr-defined]
    return kept


def fused_rotary(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """`rotate` compiled into one kernel (forward and backward); the signature Megatron calls."""
    if interleaved:
        raise NotImplementedError("interleaved RoPE has no fused kernel here")
    return _compiled_rotate()(t, *cos_sin(freqs))


def use_fused_kernels() -> dict[str, bool]:
    """Fill Megatron's fused-RoPE hook; returns the ``TransformerConfig`` fields that turn both on.

    Called before the config is built: its validation refuses ``apply_rope_fusion`` while the hook
    is empty. A TransformerEngine kernel already in the hook is kept.
    """
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rotary
    return {"apply_rope_fusion": True, "bias_activation_fusion": True}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, in fp32, rounded once (as torch's CUDA kernel computes it)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype)


@cache
def _compiled_rms_norm() -> Any:
    return torch.compile(rms_norm)


class FusedRMSNorm(torch.nn.Module):
    """`rms_norm` compiled (one kernel forward, the backward's with its weight gradient), with the
    constructor Megatron's layer spec calls norms with and ``torch.nn.RMSNorm``'s parameter name."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        # one graph per width (hidden size, head dim), any number of rows
        torch._dynamo.maybe_mark_dynamic(rows, 0)  # no error for a single row
        torch._dynamo.mark_static(rows, 1)
        return _compiled_rms_norm()(rows, self.weight, self.eps).view(x.shape)
