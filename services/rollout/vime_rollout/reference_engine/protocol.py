"""The generate route's request body, validated as vLLM 0.26 validates it, and a little stricter.

Same field names, defaults and limits as vLLM 0.26's ``GenerateRequest`` / ``SamplingParams``
(temperature in [0, 2], top_p in (0, 1], top_k >= -1, max_tokens >= 1, logprobs <= 20, n == 1 for
greedy, ...). Two deliberate differences, both tested in ``tests/contract``: unknown fields are a
400 here (vLLM 0.26 silently drops them, which hides client typos), and vLLM sampling features
this engine does not implement (penalties, logit bias, structured outputs, ...) are a 400 naming
the field unless they are sent at their default value.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20
"""vLLM's default ``--max-logprobs``: more per-position log-probs than this is a 400."""

GREEDY_EPS = 1e-5
"""vLLM's ``_SAMPLING_EPS``: a temperature below it means greedy decoding."""

# vLLM SamplingParams fields the reference engine does not implement, with their default values:
# accepted when sent at the default (clients often send the full set), refused otherwise.
UNSUPPORTED_AT_DEFAULT: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "prompt_logprobs": None,
    "logprob_token_ids": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "structured_outputs": None,
    "extra_args": None,
    "thinking_token_budget": None,
    "repetition_detection": None,
    "routed_experts_prompt_start": 0,
    "skip_reading_prefix_cache": None,
}
# Fields vLLM itself overwrites or only uses internally: accepted and ignored.
IGNORED = ("output_kind", "skip_clone", "output_text_buffer_length")


class SamplingParams(BaseModel):
    """``sampling_params`` of a generate request (vLLM 0.26 names and defaults)."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    logprobs: int | None = Field(None, ge=-1)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Accepted only at their default (see UNSUPPORTED_AT_DEFAULT).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    """Accepted, no effect: vLLM keeps the log-probs in flat lists instead of per-position dicts,
    the response is the same."""
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    repetition_detection: dict[str, Any] | None = None
    routed_experts_prompt_start: int = 0
    skip_reading_prefix_cache: bool | None = None
    # Ignored (vLLM sets them itself).
    output_kind: Any = None
    skip_clone: Any = None
    output_text_buffer_length: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        """vLLM takes one stop string or a list of them."""
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not s for s in v):
            raise ValueError("stop cannot contain an empty string.")
        return v

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        for name, default in UNSUPPORTED_AT_DEFAULT.items():
            if getattr(self, name) != default:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported by the vime reference engine "
                    "(the CPU stand-in for vLLM); leave it at its default"
                )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs == -1 or (self.logprobs is not None and self.logprobs > MAX_LOGPROBS):
            wanted = "the whole vocabulary" if self.logprobs == -1 else str(self.logprobs)
            raise ValueError(
                f"Requested sample logprobs of {wanted}, which is greater than max allowed: {MAX_LOGPROBS}"
            )
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")
        if self.greedy and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        return self

    @property
    def greedy(self) -> bool:
        """vLLM treats a temperature below 1e-5 as greedy decoding."""
        return self.temperature < GREEDY_EPS

    def child_seed(self, index: int) -> int | None:
        """The seed of choice ``index``: vLLM gives the children of an n > 1 request seed + index."""
        if self.seed is None:
            return None
        return self.seed if self.n == 1 else self.seed + index


class GenerateRequest(BaseModel):
    """Body of ``POST /inference/v1/generate`` (vLLM 0.26's token-in/token-out route)."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParams
    request_id: str | None = None
    model: str | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    features: dict[str, Any] | None = None
    assistant_tokens_mask: list[int] | None = None
    token_offsets: list[tuple[int, int]] | None = None

    @field_validator("token_ids")
    @classmethod
    def _no_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if self.priority != 0:
            raise ValueError("priority scheduling is not enabled on this server; send priority=0")
        for name in ("kv_transfer_params", "ec_transfer_params", "features"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported by the vime reference engine")
        if self.stream:
            raise ValueError("stream=true is not supported by the vime reference engine; send stream=false")
        return self
