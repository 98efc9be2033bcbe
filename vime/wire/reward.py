"""Reward service wire schemas (seed step 26): one sample, a batch or a group, and what comes back.

A request names the reward function (``fn``: a built-in name or ``package.module:function``), the
response (text and/or token ids), the label and the function's options. The reply is always a
float reward plus what the function found (``pred``), whether verification timed out, and an
error when the function failed; ``status`` says which of the three happened, so a caller can keep
failed samples out of training.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vime.types import Sample
from vime.wire.bounds import TokenId


class RewardRequest(BaseModel):
    """One sample to score. ``label`` must be present (null only for functions that need none)."""

    model_config = ConfigDict(extra="forbid")

    response: str | None = None
    """The decoded response text."""
    response_token_ids: list[TokenId] | None = None
    """The response token ids (for user functions that work on tokens)."""
    label: Any = Field(...)
    """What the reward function checks against (the dataset's label)."""
    prompt: str | list[dict[str, Any]] | None = None
    """The prompt text or chat messages (passed to user and remote functions)."""
    fn: str | None = None
    """Reward function: a built-in name, or a package.module:function the service was started with
    (reward.allowed_functions); None uses the service default."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Options of the reward function (see GET /v1/reward-functions)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Per-sample metadata; ``metadata.rm_type`` picks the function when ``fn`` is None."""
    sample_id: str | None = Field(None, max_length=256)
    """Idempotency key: a repeated request with the same id and content gets the first answer."""

    @model_validator(mode="after")
    def _has_response(self) -> RewardRequest:
        if self.response is None and self.response_token_ids is None:
            raise ValueError("give the response text (response) or its token ids (response_token_ids)")
        return self


class RewardStatus(StrEnum):
    """ok: the function answered; timeout: it ran past the timeout; error: it failed."""

    OK = "ok"
    TIMEOUT = "timeout"
    ERROR = "error"


class RewardResult(BaseModel):
    """The score of one sample."""

    reward: float
    """The reward (timeout_reward / error_reward of the service config when status is not ok)."""
    status: RewardStatus = RewardStatus.OK
    """ok | timeout | error."""
    fn: str
    """The reward function that scored the sample."""
    pred: str | None = None
    """The answer the function extracted from the response, when it extracts one."""
    timed_out: bool = False
    """Whether verification ran past the service's per-task timeout."""
    error: str | None = None
    """What went wrong when status is error (or why the function gave up)."""
    details: dict[str, Any] = Field(default_factory=dict)
    """Function-specific extras (acc, precision/recall, reason ...)."""
    sample_id: str | None = None
    """The request's sample_id, echoed."""
    cached: bool = False
    """True when the answer came from the idempotency cache (a retried request)."""
    elapsed_s: float = 0.0
    """Seconds spent scoring (queueing in the pool included)."""


class RewardBatchRequest(BaseModel):
    """Many samples in one call; ``group`` scores them as one GRPO group (seed step 26, --group-rm)."""

    model_config = ConfigDict(extra="forbid")

    items: list[RewardRequest] = Field(..., min_length=1)
    """The samples, answered in the same order."""
    fn: str | None = None
    """Default reward function for items that name none."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Default options, overridden key by key by each item's own options."""
    group: bool = False
    """One call for the whole list: a user function receives the list and returns one reward per item."""


class RewardBatchResult(BaseModel):
    """The scores of a batch, in request order."""

    results: list[RewardResult]

    @property
    def rewards(self) -> list[float]:
        """Just the rewards, in request order."""
        return [r.reward for r in self.results]


class RewardFunctionInfo(BaseModel):
    """What a reward function expects, for GET /v1/reward-functions."""

    name: str
    description: str
    label: str
    """What the label should hold."""
    options: dict[str, Any] = Field(default_factory=dict)
    """JSON schema of the function's options."""
    needs_label: bool = True
    needs_text: bool = True
    """Whether the response text is required (token ids alone are not enough)."""


class RewardFunctionList(BaseModel):
    """The built-in functions, the default one, and how user functions are named."""

    default: str
    functions: list[RewardFunctionInfo]
    user_functions: str = (
        "package.module:function, sync or async, called with a RewardRequest (a list of them for "
        "group batches); returns a number, a bool, or a dict with 'reward' or 'score' (and optional "
        "'pred'); the module must be importable by the reward service, and the function configured "
        "at start (reward.custom_rm_path or reward.allowed_functions)"
    )


def request_from_sample(
    sample: Sample,
    *,
    fn: str | None = None,
    options: dict[str, Any] | None = None,
    sample_id: str | None = None,
) -> RewardRequest:
    """The reward request for a rollout `Sample`: its text, or its token ids when no text was decoded."""
    tokens = sample.response_tokens if sample.response_length and not sample.response else None
    return RewardRequest(
        response=sample.response if tokens is None else None,
        response_token_ids=tokens,
        label=sample.label,
        prompt=sample.prompt,
        fn=fn,
        options=dict(options or {}),
        metadata=dict(sample.metadata),
        sample_id=sample_id,
    )
