"""vLLM's token-in/token-out generate route: request building and response parsing.

Seed step 19 translates vime's sampling parameters into vLLM's; step 25 zips the response's
token ids with ``logprobs.content`` (or, from vime's own route, a list of floats:
`compact_choice`). Three response generations are understood: the seed's scalar
``weight_version``, vLLM 0.33's per-choice ``weight_versions`` spans, and vLLM 0.26 which reports
no version at all (the caller then records the version it knows the engine holds).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

LOGPROB_SENTINEL = -9999.0
"""vLLM writes this when the sampled token has no logprob entry (seed step 24); kept as is."""

GENERATE_PATH = "/inference/v1/generate"

COMPACT_GENERATE_PATH = "/vime/v1/generate"
"""The generate route of the engines vime starts: the same request as ``GENERATE_PATH``, a compact
reply (each choice's log-probs one float per token, `compact_choice`). vLLM 0.26 answers
``GENERATE_PATH`` with two pydantic objects per token (``logprobs.content[]`` with a
``top_logprobs`` entry repeating the sampled token), built and dumped on its API server's one event
loop: ~160 bytes and tens of microseconds per token."""

OUTPUT_KIND_FINAL_ONLY = 2
"""vLLM's ``RequestOutputKind.FINAL_ONLY``: the engine hands the server a request's output once, when it ends."""


def build_sampling_params(
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int | None = -1,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    logprobs: int | None = 1,
    skip_special_tokens: bool = False,
    spaces_between_special_tokens: bool = False,
    detokenize: bool | None = None,
    seed: int | None = None,
    ignore_eos: bool | None = None,
) -> dict[str, Any]:
    """vime's sampling parameters → vLLM ``sampling_params`` (seed step 19).

    ``max_new_tokens`` becomes ``max_tokens``; ``top_k`` is sent when > 0 or == -1; ``stop`` and
    ``stop_token_ids`` are omitted when empty; ``logprobs`` is omitted when None (no consumer), and
    comes with ``flat_logprobs: true`` (vLLM keeps a request's log-probs in a few flat lists instead
    of one dict and one object per position: the same response, far less for its garbage
    collector with hundreds of 1,024-token requests in flight).
    ``detokenize=False`` spares the server detokenising text the client decodes itself; it is
    dropped when stop strings are used, which need server-side text. ``output_kind`` is
    ``FINAL_ONLY``: vLLM 0.26's generate route leaves a non-streaming request at ``CUMULATIVE``,
    building an output object for every request at every decoding step that only the last one
    of is read (its OpenAI routes ask for the final output alone; the reply is the same).
    """
    sp: dict[str, Any] = {
        "max_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "output_kind": OUTPUT_KIND_FINAL_ONLY,
    }
    if logprobs is not None:
        sp["logprobs"] = logprobs
        sp["flat_logprobs"] = True
    if top_k is not None and (top_k > 0 or top_k == -1):
        sp["top_k"] = top_k
    if stop:
        sp["stop"] = list(stop)
    if stop_token_ids:
        sp["stop_token_ids"] = list(stop_token_ids)
    sp["skip_special_tokens"] = skip_special_tokens
    sp["spaces_between_special_tokens"] = spaces_between_special_tokens
    if detokenize is not None and not (detokenize is False and stop):
        sp["detokenize"] = detokenize
    if seed is not None:
        sp["seed"] = seed
    if ignore_eos is not None:
        sp["ignore_eos"] = ignore_eos
    return sp


def logprobs_to_request(score_centering_top_k: int | None) -> int:
    """How many log-probs per position to ask for: top-k + 1 for score centering (seed step 19), else
    0 — only the sampled token's. The seed asks for 1, but only the sampled token's log-prob is read
    (step 25): vLLM 0.26 answers both with one ``top_logprobs`` entry per position, the sampled
    token's (``_create_tokens_logprobs`` keeps ``max(k, 1)``), with the same value, and 0 spares its
    sampler the top-k search and its output processor a second entry per token (tests/contract)."""
    return 0 if score_centering_top_k is None else score_centering_top_k + 1


class GenerateRequest(BaseModel):
    """Body of ``POST /inference/v1/generate`` (seed step 20)."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any]
    model: str | None = None
    request_id: str | None = None
    stream: bool = False


class GenerateResult(BaseModel):
    """One parsed choice of a generate response (seed step 25)."""

    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str | None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int = 0
    weight_version: str | None = None
    weight_versions: list[dict[str, Any]] | None = None
    request_id: str | None = None

    def meta_info(self) -> dict[str, Any]:
        """The seed's meta_info dict: finish reason, version, usage."""
        return {
            "finish_reason": {"type": self.finish_reason},
            "weight_version": self.weight_version,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }


class GenerateResponseError(ValueError):
    """The engine's reply is not a generate response."""


def _floored(x: float) -> float:
    return x if x > LOGPROB_SENTINEL else LOGPROB_SENTINEL


def compact_choice(
    index: int,
    token_ids: list[int],
    log_probs: list[float] | None,
    finish_reason: str | None,
    weight_versions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One choice of a `COMPACT_GENERATE_PATH` reply: the sampled tokens' log-probs as a list of
    floats (vLLM's floor ``LOGPROB_SENTINEL`` applied, NaN included, as its own route applies it),
    or None when none were asked for."""
    choice: dict[str, Any] = {
        "index": index,
        "token_ids": token_ids,
        "logprobs": None if log_probs is None else [_floored(x) for x in log_probs],
        "finish_reason": finish_reason or "stop",
    }
    if weight_versions is not None:
        choice["weight_versions"] = weight_versions
    return choice


def _tokens_and_logprobs(choice: dict[str, Any]) -> tuple[list[int], list[float] | None]:
    token_ids = choice.get("token_ids")
    if not isinstance(token_ids, list):
        raise GenerateResponseError("choice has no token_ids list")
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, list):  # `compact_choice`
        if len(logprobs) != len(token_ids):
            raise GenerateResponseError(f"{len(logprobs)} log-probs for {len(token_ids)} tokens")
        return [int(t) for t in token_ids], [float(x) for x in logprobs]
    if not isinstance(logprobs, dict):
        return [int(t) for t in token_ids], None
    content = logprobs.get("content") or []
    # zip(strict=False) as in the seed: a shorter content list truncates the pair list.
    pairs = list(zip(token_ids, content, strict=False))
    return [int(t) for t, _ in pairs], [float(item["logprob"]) for _, item in pairs]


def _version(
    output: dict[str, Any], choice: dict[str, Any]
) -> tuple[str | None, list[dict[str, Any]] | None]:
    spans = choice.get("weight_versions")
    if isinstance(spans, list) and spans:
        # 0.33: spans over output tokens; the sample's version is the one that sampled its last token.
        return str(spans[-1].get("version")), spans
    scalar = output.get("weight_version", choice.get("weight_version"))
    return (None if scalar is None else str(scalar)), None


def parse_generate_response(output: dict[str, Any], choice_index: int = 0) -> GenerateResult:
    """Parse a non-streaming generate response (vLLM 0.26, 0.33, the seed's shape, or the compact one)."""
    if not isinstance(output, dict):
        raise GenerateResponseError(f"expected a JSON object, got {type(output).__name__}")
    if "error" in output and "choices" not in output:
        err = output["error"]
        raise GenerateResponseError(f"engine error: {err.get('message') if isinstance(err, dict) else err}")
    choices = output.get("choices")
    if not isinstance(choices, list) or len(choices) <= choice_index:
        raise GenerateResponseError("response has no choices")
    choice = choices[choice_index]
    tokens, log_probs = _tokens_and_logprobs(choice)
    usage = output.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    version, spans = _version(output, choice)
    return GenerateResult(
        token_ids=tokens,
        log_probs=log_probs,
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        cached_tokens=int(details.get("cached_tokens") or 0),
        weight_version=version,
        weight_versions=spans,
        request_id=output.get("request_id"),
    )
