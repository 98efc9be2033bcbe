"""The reply of vime's compact generate route, built from a finished vLLM ``RequestOutput``.

No vLLM import: the objects are read by their fields (``outputs[].index / token_ids / logprobs /
finish_reason``, ``prompt_token_ids``, ``num_cached_tokens``), so this runs, and is tested, without
vLLM. A choice's log-probs come from vLLM's flat lists (``flat_logprobs``: ``start_indices``,
``end_indices``, ``token_ids``, ``logprobs``) or its per-position dicts of ``Logprob``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vime.wire.vllm import LOGPROB_SENTINEL, compact_choice


def sampled_log_probs(logprobs: Any, token_ids: Sequence[int]) -> list[float]:
    """The sampled token's log-prob at each position: the first entry of each position in the flat
    lists (vLLM's sampler puts the sampled token first), or its entry in a per-position dict;
    ``LOGPROB_SENTINEL`` where the position has none (as vLLM's own reply)."""
    if hasattr(logprobs, "start_indices"):
        values, ids = logprobs.logprobs, logprobs.token_ids
        return [
            values[a] if a < b and ids[a] == t else LOGPROB_SENTINEL
            for a, b, t in zip(logprobs.start_indices, logprobs.end_indices, token_ids, strict=False)
        ]
    return [
        position[t].logprob if position and t in position else LOGPROB_SENTINEL
        for position, t in zip(logprobs, token_ids, strict=False)
    ]


def compact_reply(final: Any, request_id: str, model_name: str, with_log_probs: bool) -> dict[str, Any]:
    """The JSON body for a finished request: `compact_choice` per output, and the usage."""
    choices = []
    for out in final.outputs:
        tokens = list(out.token_ids)
        log_probs = None
        if with_log_probs:
            found = out.logprobs is not None
            log_probs = sampled_log_probs(out.logprobs, tokens) if found else [LOGPROB_SENTINEL] * len(tokens)
        choices.append(compact_choice(out.index, tokens, log_probs, out.finish_reason))
    prompt = len(final.prompt_token_ids)
    completion = sum(len(c["token_ids"]) for c in choices)
    return {
        "request_id": request_id,
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens or 0},
        },
    }
