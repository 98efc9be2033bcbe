"""The data source: prompts → groups of deep-copied samples (seed step 16), with a saved position.

Each prompt becomes ``n_samples_per_prompt`` independent deep copies numbered with
``group_index`` (per prompt) and ``index`` (per sample), both counting up over the whole run, and
a ``session_id`` routing key per sample (step 17). Aborted groups handed back (partial rollout)
are served first next time. The position (epoch, offset, counters, that buffer) is a plain JSON
dict, saved with the run's checkpoints and restored on resume, so a resumed run continues with
the prompts it had not seen yet.
"""

from __future__ import annotations

import random
from typing import Any

from vime.types import Sample
from vime_rollout.data.dataset import PromptDataset, PromptTemplate

STATE_VERSION = 1


class DataStateError(ValueError):
    """A saved data-source state that does not fit this data source."""


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
        """Continue from a saved position; refuses one saved for another dataset or group size."""
        try:
            if state.get("version") != STATE_VERSION:
                raise DataStateError(
                    f"data-source state version {state.get('version')!r} is not {STATE_VERSION}"
                )
            if state["dataset_size"] != len(self.dataset):
                raise DataStateError(
                    f"data-source state was saved for {state['dataset_size']} prompts, "
                    f"this dataset has {len(self.dataset)}"
                )
            if state["n_samples_per_prompt"] != self.n_samples_per_prompt:
                raise DataStateError(
                    f"data-source state was saved with n_samples_per_prompt={state['n_samples_per_prompt']}, "
                    f"this run uses {self.n_samples_per_prompt}"
                )
            epoch, offset = int(state["epoch"]), int(state["offset"])
            if epoch < 0 or not 0 <= offset <= len(self.dataset):
                raise DataStateError(f"data-source position epoch={epoch} offset={offset} is out of range")
            buffer = [[Sample.model_validate(s) for s in group] for group in state["buffer"]]
            counters = int(state["sample_index"]), int(state["sample_group_index"])
            seed = int(state["seed"])
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, DataStateError):
                raise
            raise DataStateError(f"malformed data-source state: {exc!r}") from None
        self.seed, self.epoch, self.offset = seed, epoch, offset
        self.sample_index, self.sample_group_index = counters
        self.buffer = buffer
        self._order = self._epoch_order(epoch)
