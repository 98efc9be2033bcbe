"""The data source: prompts → groups of deep-copied samples (seed step 16), with a saved position.

Each prompt becomes ``n_samples_per_prompt`` independent deep copies numbered with
``group_index`` (per prompt) and ``index`` (per sample), both counting up over the whole run, and
a ``session_id`` routing key per sample (step 17). Aborted groups handed back (partial rollout)
are served first next time. The position (epoch, offset, counters, that buffer) is a plain JSON
dict, saved with the run's checkpoints and restored on resume, so a resumed run continues with
the prompts it had not seen yet. A state to restore is checked whole (`SavedPosition`, every
number in range) before any of it is used, so a bad one cannot break a later rollout.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from vime.types import Sample
from vime.wire.bounds import MAX_ID, MAX_TOKEN_ID, Id
from vime_rollout.data.dataset import PromptDataset, PromptTemplate

STATE_VERSION = 1


class DataStateError(ValueError):
    """A saved data-source state that does not fit this data source (409)."""

    status_code = 409


class MalformedDataState(DataStateError):
    """A data-source state with a missing, mistyped or out-of-range field (422, the field named)."""

    status_code = 422


class SavedPosition(BaseModel):
    """The fields of a saved position that a restore reads, each in range."""

    dataset_size: int
    n_samples_per_prompt: int
    seed: int = Field(ge=-MAX_ID, le=MAX_ID)
    epoch: Id
    offset: Id
    sample_index: Id
    sample_group_index: Id
    buffer: list[list[Sample]]


def _check_buffer(groups: list[list[Sample]]) -> None:
    """Handed-back samples must be continuable: token ids and indices in range, lists consistent."""
    for g, group in enumerate(groups):
        for i, s in enumerate(group):
            where = f"state.buffer.{g}.{i}"
            if any(not 0 <= t <= MAX_TOKEN_ID for t in s.tokens):
                raise MalformedDataState(f"{where}.tokens: token ids must be in [0, {MAX_TOKEN_ID}]")
            for name in ("index", "group_index"):
                value = getattr(s, name)
                if value is not None and not 0 <= value <= MAX_ID:
                    raise MalformedDataState(f"{where}.{name}: must be in [0, {MAX_ID}]")
            try:
                s.check_consistent()
            except ValueError as exc:
                raise MalformedDataState(f"{where}: {exc}") from None


class DataSource:
    """Hands out prompt groups in a seeded, per-epoch shuffled order that a restart reproduces."""

    def __init__(
        self, dataset: PromptDataset, n_samples_per_prompt: int, *, shuffle: bool = True, seed: int = 0
    ) -> None:
        if n_samples_per_prompt < 1:
            raise ValueError("n_samples_per_prompt must be >= 1")
        self.dataset = dataset
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self.sample_index = 0
        self.sample_group_index = 0
        self.buffer: list[list[Sample]] = []
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _next_prompt_index(self) -> int:
        if self.offset >= len(self._order):
            self.epoch += 1
            self.offset = 0
            self._order = self._epoch_order(self.epoch)
        idx = self._order[self.offset]
        self.offset += 1
        return idx

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """``num_groups`` groups: handed-back (aborted) groups first, then new prompts."""
        groups: list[list[Sample]] = []
        while self.buffer and len(groups) < num_groups:
            groups.append(self.buffer.pop(0))
        while len(groups) < num_groups:
            groups.append(self._make_group(self.dataset.prompts[self._next_prompt_index()]))
        return groups

    def _make_group(self, template: PromptTemplate) -> list[Sample]:
        group = []
        for _ in range(self.n_samples_per_prompt):
            sample = template.to_sample()
            sample.group_index = self.sample_group_index
            sample.index = self.sample_index
            sample.session_id = f"g{self.sample_group_index}-s{self.sample_index}"
            self.sample_index += 1
            group.append(sample)
        self.sample_group_index += 1
        return group

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Take back groups of aborted samples (partial rollout): they are served first next time."""
        for group in groups:
            if len(group) != self.n_samples_per_prompt:
                raise ValueError(
                    f"a group handed back has {len(group)} samples, not {self.n_samples_per_prompt}"
                )
            self.buffer.append(group)

    # --- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position as plain JSON values."""
        return {
            "version": STATE_VERSION,
            "dataset": self.dataset.name,
            "dataset_size": len(self.dataset),
            "n_samples_per_prompt": self.n_samples_per_prompt,
            "seed": self.seed,
            "epoch": self.epoch,
            "offset": self.offset,
            "sample_index": self.sample_index,
            "sample_group_index": self.sample_group_index,
            "buffer": [[s.model_dump(mode="json") for s in group] for group in self.buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses one saved for another dataset or group size
        (`DataStateError`) and a malformed one (`MalformedDataState`, naming the field), changing
        nothing in either case."""
        if state.get("version") != STATE_VERSION:
            raise DataStateError(f"data-source state version {state.get('version')!r} is not {STATE_VERSION}")
        try:
            saved = SavedPosition.model_validate(state)
        except ValidationError as exc:
            problems = [f"state.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
            raise MalformedDataState("malformed data-source state: " + "; ".join(problems[:5])) from None
        if saved.dataset_size != len(self.dataset):
            raise DataStateError(
                f"data-source state was saved for {saved.dataset_size} prompts, "
                f"this dataset has {len(self.dataset)}"
            )
        if saved.n_samples_per_prompt != self.n_samples_per_prompt:
            raise DataStateError(
                f"data-source state was saved with n_samples_per_prompt={saved.n_samples_per_prompt}, "
                f"this run uses {self.n_samples_per_prompt}"
            )
        if saved.offset > len(self.dataset):
            raise MalformedDataState(
                f"state.offset: {saved.offset} is past the end of the {len(self.dataset)} prompts"
            )
        if any(len(group) != self.n_samples_per_prompt for group in saved.buffer):
            raise MalformedDataState(
                f"state.buffer: every group must hold {self.n_samples_per_prompt} samples"
            )
        _check_buffer(saved.buffer)
        self.seed, self.epoch, self.offset = saved.seed, saved.epoch, saved.offset
        self.sample_index, self.sample_group_index = saved.sample_index, saved.sample_group_index
        self.buffer = saved.buffer
        self._order = self._epoch_order(saved.epoch)
