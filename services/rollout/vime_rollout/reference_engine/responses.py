"""JSON bodies in vLLM 0.26's shapes: the generate response and ``/v1/models``.

The generate response is byte-for-byte the structure vLLM 0.26 returns (``choices[].token_ids``,
``logprobs.content[]`` with ``"token": "token_id:N"``, ``bytes: null`` and ``top_logprobs``,
``usage``, the null ``prompt_logprobs`` / ``kv_transfer_params`` / ``ec_transfer_params``).
One 0.33 extra: once a weight version has been set with ``/finish_weight_update``, every choice
carries ``weight_versions`` spans ``[{"version", "start", "end"}]`` over its output tokens (tokens
sampled before any version was set are labelled ``"default"``, 0.33's initial label). vLLM 0.26
has no weight version at all; see ``tests/contract`` for how that difference is tested. vime's
own route (``/vime/v1/generate``, which the vLLM engines vime starts serve too) answers the same
with each choice's log-probs as a list of floats.
"""

from __future__ import annotations

import time
from typing import Any

from vime.wire.vllm import compact_choice

from .sequence import Request, Sequence

DEFAULT_VERSION = "default"


def _entry(token: int, logprob: float) -> dict[str, Any]:
    return {"token": f"token_id:{token}", "logprob": logprob, "bytes": None}


def _logprobs(seq: Sequence) -> dict[str, Any] | None:
    if seq.params.logprobs is None:
        return None
    content = []
    for token, logprob, top in zip(seq.output, seq.logprobs, seq.top, strict=True):
        item = _entry(token, logprob)
        item["top_logprobs"] = [_entry(t, lp) for t, lp in (top or [])]
        content.append(item)
    return {"content": content}


def weight_version_spans(versions: list[str | None]) -> list[dict[str, Any]] | None:
    """Half-open spans of output-token indices per weight version, or None when none was ever set."""
    if all(v is None for v in versions):
        return None
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        label = DEFAULT_VERSION if v is None else v
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


def _compact_choice(seq: Sequence) -> dict[str, Any]:
    log_probs = None if seq.params.logprobs is None else list(seq.logprobs)
    return compact_choice(
        seq.index, list(seq.output), log_probs, seq.finish_reason, weight_version_spans(seq.versions)
    )


def _choice(seq: Sequence) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": seq.index,
        "logprobs": _logprobs(seq),
        "finish_reason": seq.finish_reason or "stop",
        "token_ids": list(seq.output),
        "routed_experts": None,
    }
    spans = weight_version_spans(seq.versions)
    if spans is not None:
        choice["weight_versions"] = spans
    return choice


def generate_response(
    request: Request, model_name: str, created: int | None = None, *, compact: bool = False
) -> dict[str, Any]:
    """The body of a finished (or aborted) generate request; ``compact``: as vime's own route
    answers (`vime.wire.vllm.COMPACT_GENERATE_PATH`)."""
    completion = sum(len(s.output) for s in request.sequences)
    prompt = len(request.prompt)
    choice = _compact_choice if compact else _choice
    return {
        "request_id": request.request_id,
        "model": model_name,
        "created": int(time.time()) if created is None else created,
        "choices": [choice(s) for s in request.sequences],
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def models_response(model_name: str, root: str, max_model_len: int, created: int) -> dict[str, Any]:
    """``GET /v1/models`` as vLLM answers it."""
    return {
        "object": "list",
        "data": [
            {
                "id": model_name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{model_name}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }
