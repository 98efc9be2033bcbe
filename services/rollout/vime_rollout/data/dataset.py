"""Building a prompt dataset: render, tokenise, and drop prompts that are too long.

The seed filters prompts by length when the dataset is built (data_source.py:84–97), so a rollout
never sends a prompt longer than ``rollout_max_prompt_len``; the number dropped is counted and
reported instead of being silently lost.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vime.types import Sample


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the rollout manager uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class DatasetError(ValueError):
    """A dataset that cannot be used (missing keys, nothing left after filtering)."""


@dataclass(frozen=True)
class PromptTemplate:
    """One prompt, tokenised: what every sample of its group is a deep copy of."""

    prompt: str | list[dict[str, Any]]
    label: Any
    token_ids: tuple[int, ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_sample(self) -> Sample:
        """A fresh Sample holding this prompt (tokens = prompt tokens, no response yet).

        Everything mutable is copied deeply, so samples made from one template share nothing
        (the seed's ``copy.deepcopy`` per group member, at a seventh of the cost).
        """
        return Sample(
            prompt=copy.deepcopy(self.prompt),
            label=copy.deepcopy(self.label),
            tokens=list(self.token_ids),
            metadata=copy.deepcopy(self.metadata),
        )


@dataclass(frozen=True)
class PromptDataset:
    """The prompts of one data file (or the synthetic task), after the length filter."""

    name: str
    prompts: list[PromptTemplate]
    num_dropped_too_long: int = 0
    num_records: int = 0

    def __len__(self) -> int:
        return len(self.prompts)


def render_prompt(tokenizer: Tokenizer, prompt: Any, apply_chat_template: bool) -> str:
    """The text sent to the engine: the prompt itself, or its chat-template rendering."""
    if apply_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return str(text)
    if isinstance(prompt, list):
        raise DatasetError("prompt is a list of chat messages: set data.apply_chat_template=true")
    return str(prompt)


def build_dataset(
    name: str,
    records: Iterable[dict[str, Any]],
    tokenizer: Tokenizer,
    *,
    input_key: str,
    label_key: str,
    metadata_key: str | None,
    apply_chat_template: bool,
    max_prompt_len: int,
    extra_metadata: dict[str, Any] | None = None,
) -> PromptDataset:
    """Tokenise every record's prompt; keep those of at most ``max_prompt_len`` tokens."""
    kept: list[PromptTemplate] = []
    dropped = 0
    count = 0
    for count, record in enumerate(records, 1):
        if input_key not in record:
            raise DatasetError(f"{name}: record {count} has no {input_key!r} field (data.input_key)")
        prompt = record[input_key]
        token_ids = tokenizer.encode(
            render_prompt(tokenizer, prompt, apply_chat_template), add_special_tokens=False
        )
        if not token_ids:
            raise DatasetError(f"{name}: record {count} has an empty prompt")
        if len(token_ids) > max_prompt_len:
            dropped += 1
            continue
        metadata = dict(extra_metadata or {})
        if metadata_key and isinstance(record.get(metadata_key), dict):
            metadata.update(record[metadata_key])
        kept.append(PromptTemplate(prompt, record.get(label_key), tuple(token_ids), metadata))
    if not kept:
        raise DatasetError(
            f"{name}: no prompt left out of {count} records"
            + (f" ({dropped} longer than rollout_max_prompt_len={max_prompt_len})" if dropped else "")
        )
    return PromptDataset(name, kept, num_dropped_too_long=dropped, num_records=count)
