"""`Sample`: one prompt's one response as it moves through a rollout (seed steps 16, 19, 25)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class SampleStatus(StrEnum):
    """Where a sample stands; `finish_reason` of the engine maps onto it (see `from_finish_reason`)."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"

    @classmethod
    def from_finish_reason(cls, reason: str | None) -> SampleStatus:
        """vLLM finish reasons: stop → completed, length → truncated, abort → aborted, else failed."""
        return {
            "stop": cls.COMPLETED,
            "length": cls.TRUNCATED,
            "abort": cls.ABORTED,
        }.get(reason or "", cls.FAILED)


class Sample(BaseModel):
    """A prompt and its (growing) response. ``tokens`` = prompt tokens + response tokens.

    The per-response-token lists (``loss_mask``, ``rollout_log_probs``) always have
    ``response_length`` entries; `append_response_tokens` keeps them in step.
    """

    model_config = ConfigDict(validate_assignment=False)

    prompt: str | list[dict[str, Any]] = ""
    """The prompt text, or chat messages."""
    label: Any = None
    """What the reward function checks against."""
    tokens: list[int] = Field(default_factory=list)
    """Prompt token ids followed by response token ids."""
    response: str = ""
    """Decoded response text."""
    response_length: int = 0
    """Number of response tokens at the end of ``tokens``."""
    loss_mask: list[int] = Field(default_factory=list)
    """1 for response tokens that are trained on, 0 for masked ones; one entry per response token."""
    rollout_log_probs: list[float] | None = None
    """The engine's log-prob of each response token; None when they were not requested."""
    reward: float | None = None
    """Scalar reward from the reward service."""
    reward_details: dict[str, Any] | None = None
    """What the reward function reported besides the score (extracted answer, timeout ...)."""
    status: SampleStatus = SampleStatus.PENDING
    """pending | completed | truncated | aborted | failed."""
    group_index: int | None = None
    """Index of the prompt group within the data source (seed step 16)."""
    index: int | None = None
    """Index of the sample within the data source (seed step 16)."""
    session_id: str | None = None
    """Routing key for consistent hashing (seed step 17)."""
    weight_version: str | None = None
    """Weight version that sampled the response's last token."""
    first_weight_version: str | None = None
    """Weight version that sampled its first token: older than ``weight_version`` when new weights
    reached the engine while it was generated (an in-flight update, a continued partial sample).
    It bounds how stale the sample is."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free-form per-sample data (e.g. rm_type, finish reason, usage)."""

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens at the start of ``tokens``."""
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        """The response part of ``tokens``."""
        return self.tokens[self.prompt_length :]

    def remaining_new_tokens(self, max_new_tokens: int) -> int:
        """Tokens still allowed after what was already generated (seed step 19: max_new_tokens -= response_length)."""
        return max_new_tokens - self.response_length

    def append_response_tokens(
        self,
        tokens: list[int],
        log_probs: list[float] | None = None,
        *,
        trainable: bool = True,
        text: str | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> None:
        """Extend tokens, response_length, loss_mask and rollout_log_probs together (seed step 25).

        Refuses log-probs whose count differs from the tokens', and a chunk without log-probs for
        a sample that already carries them (or the other way round), so the lists never drift.
        """
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(
                f"append_response_tokens: {len(tokens)} tokens but {len(log_probs)} log-probs; "
                "every response token needs exactly one log-prob"
            )
        has_lp = self.rollout_log_probs is not None
        if self.response_length and has_lp != (log_probs is not None):
            raise ValueError(
                "append_response_tokens: this sample "
                + ("carries" if has_lp else "has no")
                + " rollout log-probs, the new chunk "
                + ("has none" if has_lp else "does")
            )
        self.tokens.extend(tokens)
        self.response_length += len(tokens)
        self.loss_mask.extend([1 if trainable else 0] * len(tokens))
        if log_probs is not None:
            self.rollout_log_probs = (self.rollout_log_probs or []) + [float(x) for x in log_probs]
        if text is not None:
            self.response += text
        if meta_info:
            self.metadata.update(meta_info)
            if meta_info.get("weight_version") is not None:
                self.weight_version = str(meta_info["weight_version"])

    def check_consistent(self) -> None:
        """Raise if the per-response-token lists disagree with ``response_length``."""
        if len(self.loss_mask) != self.response_length:
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries, response_length is {self.response_length}"
            )
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(
                f"rollout_log_probs has {len(self.rollout_log_probs)} entries, response_length is {self.response_length}"
            )
        if self.response_length > len(self.tokens):
            raise ValueError("response_length exceeds the number of tokens")
