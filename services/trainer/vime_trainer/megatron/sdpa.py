"""Core attention through torch's own kernels (no TransformerEngine): padded SDPA or packed samples.

Megatron's local spec computes attention by materialising the full ``[b·heads, s, s]`` score
matrix; on an H200 that made a Qwen3-0.6B step 1.8× slower and used twice the memory of torch
SDPA (notes/gpu_baselines.md). This module replaces ``core_attention`` in the layer spec — a
supported ModuleSpec swap — for causal self-attention with grouped KV heads.

Right-padded ``[s, b]`` batches need no mask: attention is causal, so padding never reaches a real
token. Packed micro-batches (`PackedSamples`: the samples concatenated into one ``[T, 1]``
sequence) must keep each token within its own sample; three kernels do that, chosen by
``packed_attention`` (they agree to float tolerance, tests/unit/trainer/test_packed_attention.py):

- ``varlen``: ``torch.nn.attention.varlen.varlen_attn``, FlashAttention over ``cu_seqlens`` (CUDA);
- ``flex``: FlexAttention with a block-diagonal causal block mask, compiled (CUDA for training);
- ``segments``: one SDPA call per sample (any device; the CPU path and the reference).
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable
from functools import cache
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from vime_trainer.megatron.micro_batch import PackedSamples

PackedKernel = Literal["varlen", "flex", "segments"]
# (q [T, Hq, d], k [T, Hkv, d], v [T, Hkv, d], packing, scale) -> [T, Hq, d]
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PackedSamples, float], torch.Tensor]


def resolve_packed_kernel(name: str, on_gpu: bool) -> PackedKernel:
    """``auto`` is ``varlen`` on GPU and ``segments`` on CPU; the GPU-only kernels are refused on CPU."""
    if name == "auto":
        return "varlen" if on_gpu else "segments"
    if name not in ("varlen", "flex", "segments"):
        raise ValueError(f"packed_attention={name!r}: choose auto, varlen, flex or segments")
    if not on_gpu and name != "segments":
        raise ValueError(
            f"packed_attention={name!r} needs a GPU (its backward has no CPU kernel); use segments"
        )
    return name  # type: ignore[return-value]


def segments_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: PackedSamples, scale: float
) -> torch.Tensor:
    """Causal SDPA of each sample on its own slice of the packed sequence."""
    bounds = packing.bounds
    outs = []
    for start, end in itertools.pairwise(bounds):
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, n, d]
        out = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=qs.shape[1] != ks.shape[1]
        )
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


@cache
def _varlen() -> tuple[Callable[..., Any], dict[str, Any]]:
    """torch's varlen_attn and the keyword arguments its version takes for causal attention.

    torch 2.9 takes ``is_causal``; 2.10+ express causality as ``window_size=(-1, 0)``; 2.12+
    accept ``enable_gqa`` (FlashAttention itself handles fewer KV heads in every version).
    ``scale`` is passed when the signature has it (None stands for "has it, fill in per call").
    """
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    for name in ("enable_gqa", "scale"):
        if name in params:
            kwargs[name] = None
    return varlen_attn, kwargs


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: PackedSamples, scale: float
) -> torch.Tensor:
    fn, kwargs = _varlen()
    if "scale" in kwargs:
        kwargs = {**kwargs, "scale": scale}
    elif not math.isclose(scale, q.shape[-1] ** -0.5):
        raise ValueError("this torch's varlen_attn takes no scale, and the model's is not 1/sqrt(head_dim)")
    if "enable_gqa" in kwargs:
        kwargs = {**kwargs, "enable_gqa": q.shape[1] != k.shape[1]}
    cu, n = packing.cu_seqlens_q, packing.max_seqlen_q
    return fn(q, k, v, cu, cu, n, n, **kwargs)


@cache
def _flex_compiled() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: PackedSamples, scale: float
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as eager

    # Compiled on GPU (its fused kernel); eager elsewhere (a reference implementation, no backward).
    attend = _flex_compiled() if q.is_cuda else cast(Callable[..., Any], eager)
    total = q.shape[0]
    mask = packing.cache.get("flex_block_mask")
    if mask is None:  # once per micro-batch, shared by every layer
        doc = torch.repeat_interleave(
            torch.arange(len(packing.bounds) - 1, device=q.device),
            torch.diff(torch.tensor(packing.bounds, device=q.device)),
        )

        def document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        mask = create_block_mask(document_causal, None, None, total, total, device=q.device)
        packing.cache["flex_block_mask"] = mask
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, d]
    out = attend(qs, ks, vs, block_mask=mask, scale=scale, enable_gqa=qs.shape[1] != ks.shape[1])
    return out.squeeze(0).transpose(0, 1)


PACKED_KERNELS: dict[str, Kernel] = {
    "varlen": varlen_attention,
    "flex": flex_document_attention,
    "segments": segments_attention,
}


class SDPAttention(MegatronModule):
    """Causal GQA attention on ``[s, b, heads, head_dim]`` inputs, output ``[s, b, heads·head_dim]``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        packed_kernel: PackedKernel = "segments",
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention supports causal self-attention only, got {attn_mask_type}")
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.packed_kernel = PACKED_KERNELS[packed_kernel]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias")
        seq, batch = query.shape[0], query.shape[1]
        if packed_seq_params is not None:
            if not isinstance(packed_seq_params, PackedSamples) or batch != 1:
                raise ValueError("SDPAttention takes packed samples as PackedSamples over a [T, 1] sequence")
            if self.dropout and self.training:
                raise ValueError("packed attention has no dropout; set attention_dropout=0")
            q, k, v = (t.squeeze(1) for t in (query, key, value))
            out = self.packed_kernel(q, k, v, packed_seq_params, self.softmax_scale)
            return out.reshape(seq, 1, -1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
