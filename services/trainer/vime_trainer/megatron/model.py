"""Build the Megatron GPT model for an HF architecture and load HF weights into this rank's shard.

`PolicyModel` is megatron-core's ``GPTModel`` whose last pipeline stage returns the final hidden
states instead of full-vocabulary logits: RL needs the log-probs of response tokens only, and
`logprobs` computes them in chunks from the hidden states (``output_logits`` applies the
vocab-parallel output layer to whatever positions it is given). For packed micro-batches
(`micro_batch.PackedSamples`) it gives each token the RoPE frequencies of its position within its
own sample. The same code runs on GPU (bf16 parameters, SDPA attention) and on CPU (fp32, the CPU
shim).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from vime.config import TrainerConfig
from vime_trainer.megatron.fused import FusedRMSNorm, use_fused_kernels
from vime_trainer.megatron.runtime import RankInfo
from vime_trainer.weights.architecture import Architecture
from vime_trainer.weights.hf_checkpoint import HFReader
from vime_trainer.weights.hf_mapping import hf_sources, local_to_global, to_mcore
from vime_trainer.weights.tp_layout import shard


class PolicyModel(GPTModel):
    """GPTModel returning hidden states ``[s, b, h]`` on every stage (final norm applied on the last)."""

    def _preprocess(self, **kwargs: Any) -> Any:
        """Megatron's embedding and RoPE; for packed samples, RoPE at each token's ``position_ids``.

        Megatron computes the frequencies of positions ``0..max_seqlen−1`` (``[max_seqlen, 1, 1,
        d]``); gathering them by the per-sample positions gives the ``[T, 1, 1, d]`` frequencies it
        then applies to the packed ``[T, 1, heads, d]`` queries and keys like any ``[s, b]`` batch.
        """
        out = super()._preprocess(**kwargs)
        if kwargs.get("packed_seq_params") is None or out[1] is None:
            return out
        per_token = out[1].index_select(0, kwargs["position_ids"].reshape(-1))
        return (out[0], per_token, *out[2:])

    def _postprocess(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits ``[s, b, vocab/tp]`` of hidden states ``[s, b, h]`` (last stage only)."""
        weight = (
            self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        )
        logits, _ = self.output_layer(hidden, weight=weight)
        return logits


def params_dtype(trainer: TrainerConfig, on_gpu: bool) -> torch.dtype:
    """bf16 on GPU when configured; CPU always trains in fp32."""
    return torch.bfloat16 if on_gpu and trainer.bf16 else torch.float32


def transformer_config(
    arch: Architecture, info: RankInfo, dtype: torch.dtype, recompute_activations: bool = False
) -> TransformerConfig:
    """Megatron's config for ``arch``: RMSNorm, SwiGLU, RoPE, GQA, no dropout.

    On the GPU, RoPE and SwiGLU are fused (`fused.use_fused_kernels`); the CPU runs Megatron's
    unfused code. ``recompute_activations``: Megatron's full recomputation, one layer per checkpoint (backward
    reruns each layer's forward instead of keeping its activations).
    """
    on_gpu = info.device.startswith("cuda")
    recompute: dict[str, Any] = (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        if recompute_activations
        else {}
    )
    fusions = use_fused_kernels() if on_gpu else {"apply_rope_fusion": False, "bias_activation_fusion": False}
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not on_gpu,
        # Init is overwritten by the checkpoint, but perform_initialization=False would also skip
        # tagging TP-sharded weights, and the grad norm would then count only TP rank 0.
        perform_initialization=True,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=info.tp_size,
        pipeline_model_parallel_size=info.pp_size,
        variable_seq_lengths=info.pp_size > 1,  # micro-batches are padded to their own longest sample
        moe_token_dispatcher_type="alltoall",  # dense model; the default refuses variable_seq_lengths
        **fusions,
        **recompute,
    )


def layer_spec(
    arch: Architecture, use_sdpa: bool, packed_kernel: str = "segments", fused_norm: bool = False
) -> ModuleSpec:
    """The local (non-TransformerEngine) layer spec, with SDPA core attention when asked.

    ``packed_kernel`` is the SDPA module's kernel for packed micro-batches (`sdpa.PACKED_KERNELS`);
    ``fused_norm`` puts `fused.FusedRMSNorm` in place of every norm of a layer (GPU only).
    """
    spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_layernorm, normalization="RMSNorm")
    if fused_norm:
        sub = spec.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = FusedRMSNorm
        if arch.qk_layernorm:
            sub.self_attention.submodules.q_layernorm = FusedRMSNorm
            sub.self_attention.submodules.k_layernorm = FusedRMSNorm
    if use_sdpa:
        from vime_trainer.megatron.sdpa import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=SDPAttention, params={"packed_kernel": packed_kernel}
        )
    return spec


def build_model(arch: Architecture, trainer: TrainerConfig, info: RankInfo) -> PolicyModel:
    """This rank's model shard on its device (weights uninitialised until loaded)."""
    from vime_trainer.megatron.sdpa import resolve_packed_kernel

    arch.check_parallel(info.tp_size, info.pp_size)
    on_gpu = info.device.startswith("cuda")
    dtype = params_dtype(trainer, on_gpu)
    model = PolicyModel(
        transformer_config(arch, info, dtype, trainer.recompute_activations),
        layer_spec(
            arch,
            trainer.use_sdpa,
            resolve_packed_kernel(trainer.packed_attention, on_gpu),
            fused_norm=on_gpu and trainer.fused_norm,
        ),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=info.is_first_stage,
        post_process=info.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,  # megatron annotates int; floats work
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
    )
    one_param_dtype(model.to(info.device), dtype)  # in place
    return model


def one_param_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Give every parameter ``dtype``.

    Without Apex/TE, Megatron's local spec builds ``torch.nn.RMSNorm``, whose weight takes the
    default dtype (fp32) whatever ``params_dtype`` says. Megatron's mixed-precision optimizer then
    keeps those in a separate fp32 group, and its ``sharded_state_dict`` (checkpoints) only maps
    the bf16 group: "Param id N does not match any model sharded param" (seen on the H200).
    bf16 norm weights are also what HF's bf16 model and vLLM use.
    """
    for param in model.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def layer_offset(arch: Architecture, info: RankInfo) -> int:
    """Global index of this pipeline stage's first layer."""
    return info.pp_rank * (arch.num_layers // info.pp_size)


def local_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters by Megatron name (no DDP ``module.`` prefix)."""
    inner = getattr(model, "module", model)
    return dict(inner.named_parameters())


def load_hf_weights(model: torch.nn.Module, arch: Architecture, checkpoint: str, info: RankInfo) -> int:
    """Copy this rank's shard of every parameter from an HF checkpoint; returns the count loaded."""
    reader = HFReader(checkpoint)
    offset = layer_offset(arch, info)
    params = local_parameters(model)
    with torch.no_grad():
        for name, param in params.items():
            full_name = local_to_global(name, offset)
            full = to_mcore(arch, full_name, [reader.get(s) for s in hf_sources(arch, full_name)])
            local = shard(full_name, full, info.tp_rank, info.tp_size)
            if local.shape != param.shape:
                raise ValueError(
                    f"{full_name}: checkpoint shard {tuple(local.shape)} != parameter {tuple(param.shape)}"
                )
            param.copy_(local.to(device=param.device, dtype=param.dtype))
    return len(params)
