"""Log-probs (and entropy) of response tokens, chunk by chunk, vocab-parallel under TP.

The loss needs one log-prob per response token, not full-vocabulary fp32 logits for every position
of the batch (9 GB at 8 × 2048 tokens × 152k vocab). So only the hidden states that predict
response tokens are gathered, and they go through the output layer ``chunk_size`` tokens at a
time; each chunk's logits are upcast to fp32, reduced to (log-prob, entropy), and dropped (on the
GPU fused by ``torch.compile``, `compiled_stats`). While
training, each chunk runs under activation checkpointing, so backward recomputes its logits
instead of keeping every chunk's alive: no more than one chunk's ``[chunk, vocab]`` fp32 tensors
exist at a time, for the log-probs and the entropy alike. Under TP each rank holds a vocabulary
slice: the max, the normaliser and the target logit are combined with all-reduces that pass
gradients straight through (the loss is replicated on every TP rank).

The distribution is the one the engines sample from: logits divided by the rollout temperature
(as slime does), so the PPO ratio and the train/inference mismatch compare like with like — the
engines report log-probs of the same tempered distribution (vLLM's ``processed_logprobs``). The
division happens on the fp32 chunk, inside the checkpointed function, so it costs no memory.
Top-k / top-p are not applied here (nor in slime): with them on, the engines' log-probs are of the
truncated distribution, and the mismatch metric shows the renormalisation.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

LOGPROBS_RANGE = "vime/logprobs"
"""Profiler range around each chunk's output layer and log-prob/entropy computation."""


def local_stats(
    logits: torch.Tensor,
    shift: torch.Tensor,
    local_target: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's sums over its vocabulary slice: (Σ exp, the target's shifted logit, Σ exp·shifted).

    ``shifted`` is ``logits / temperature − shift`` in fp32; ``local_target`` is −1 where the target
    is in another rank's slice (its term is 0). On the GPU this runs compiled (`compiled_stats`):
    a few fused kernels forward and backward instead of one per operation over ``[n, vocab/tp]``
    (the 4B step's output layer + log-prob pass went from 229 to 127 ms on the H200).
    """
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    shifted = x - shift.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    in_range = local_target >= 0
    picked = shifted.gather(-1, local_target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * in_range
    if not with_entropy:
        return sum_exp, picked, torch.zeros_like(sum_exp)
    if not entropy_grad:
        shifted, exp = shifted.detach(), exp.detach()
    return sum_exp, picked, (exp * shifted).sum(dim=-1)


@cache
def _compiled_stats() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return torch.compile(local_stats)


def compiled_stats(
    logits: torch.Tensor, shift: torch.Tensor, local_target: torch.Tensor, *options: float | bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`local_stats` (its ``options`` are the temperature and the two entropy flags) compiled with
    the row count symbolic from the first call, the vocabulary size static.

    A chunk's row count is whatever is left of a micro-batch's response tokens. Left to torch's
    automatic dynamic shapes, the first graph is specialised to its row count and the first other
    count recompiles it, forward and backward, in the middle of a step: on the H100, after steps
    whose samples were all 1,024 tokens long, the first step with a shorter one trained 2.4 s
    longer, the GPU idle meanwhile (docs/benchmarks.md).
    """
    for t in (logits, shift, local_target):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.mark_static(logits, 1)
    return _compiled_stats()(logits, shift, local_target, *options)


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    temperature: float = 1.0,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per row of vocab-parallel ``logits [n, vocab/tp]`` / ``temperature``; fp32.

    With ``entropy_grad`` False the entropy is a metric only: it adds no backward work.
    """
    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    # max(x / T) = max(x) / T exactly: division by T > 0 is monotonic, rounding included
    local_max = logits.detach().amax(dim=-1).float()
    if temperature != 1.0:
        local_max = local_max / temperature
    if tp > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=tp_group)
    vocab = logits.shape[-1]
    local_target = targets - ps.get_tensor_model_parallel_rank() * vocab
    local_target = torch.where((local_target >= 0) & (local_target < vocab), local_target, -1)
    stats = compiled_stats if logits.is_cuda else local_stats
    sum_exp, picked, weighted = stats(
        logits, local_max, local_target, temperature, with_entropy, entropy_grad
    )
    sum_exp = reduce_from_tensor_model_parallel_region(sum_exp.contiguous())
    log_norm = sum_exp.log()
    log_probs = reduce_from_tensor_model_parallel_region(picked.contiguous()) - log_norm
    if not with_entropy:
        return log_probs, torch.zeros_like(log_probs)
    # H = log Z − Σ p·shifted, with Σ p·shifted = Σ exp·shifted / Z (summed over TP's slices).
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        weighted = reduce_from_tensor_model_parallel_region(weighted.contiguous())
        return log_probs, log_norm - weighted / sum_exp


def response_log_probs(
    output_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    index: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
    with_entropy: bool = False,
    *,
    temperature: float,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[R]`` of the response tokens of a micro-batch, at ``temperature``.

    ``hidden`` is the last stage's hidden states (``[s, b, h]``, or ``[T, 1, h]`` packed);
    ``index`` holds, for each response token, the flat index of the hidden state that predicts it,
    and ``targets`` the token ids. ``entropy_grad`` False computes the entropy as a metric only.
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: log-probs of logits / T need T > 0 (T = 0 is greedy)")
    flat = hidden.reshape(-1, hidden.shape[-1])
    checkpointed = torch.is_grad_enabled() and hidden.requires_grad

    def chunk(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with record_function(LOGPROBS_RANGE):
            logits = output_logits(h.unsqueeze(1)).squeeze(1)
            return token_stats(logits, t, with_entropy, temperature, entropy_grad)

    log_probs, entropies = [], []
    for start in range(0, index.numel(), chunk_size):
        rows = flat.index_select(0, index[start : start + chunk_size])
        tgt = targets[start : start + chunk_size]
        if checkpointed:
            lp, ent = checkpoint(chunk, rows, tgt, use_reentrant=False, preserve_rng_state=False)
        else:
            lp, ent = chunk(rows, tgt)
        log_probs.append(lp)
        entropies.append(ent)
    if not log_probs:
        empty = flat.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(log_probs), torch.cat(entropies)
