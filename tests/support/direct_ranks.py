"""A `DirectRanks` of one in-process rank over an HF state dict: the direct load's trainer side
without Ray or Megatron (the rank-side code, `direct_rank.DirectExporter`, is the real one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from vime_trainer.weight_sync.direct_plan import DirectPlan
from vime_trainer.weight_sync.direct_rank import DirectExporter
from vime_trainer.weight_sync.direct_ranks import RankBuffers
from vime_trainer.weight_sync.ipc_payload import RankGpu


class LocalRanks:
    """One rank exporting ``tensors`` (HF names, in order) through shared-memory staging buffers."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], directory: Path) -> None:
        self.tensors = dict(tensors)
        self.directory = directory
        self.exporter: DirectExporter | None = None
        self.opened = 0

    def export_spec(self) -> Mapping[str, tuple[Sequence[int], str]]:
        return {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in self.tensors.items()}

    def open(self, plan: DirectPlan, buffer_bytes: int, slots: int) -> list[RankBuffers]:
        self.close()
        self.opened += 1
        self.exporter = DirectExporter(plan, buffer_bytes, slots, "shm", share=True, directory=self.directory)
        return [RankBuffers(RankGpu(0, ""), self.exporter.specs)]

    def _open(self) -> DirectExporter:
        assert self.exporter is not None, "open first"
        return self.exporter

    def begin(self) -> None:
        self._open().begin(iter(list(self.tensors.items())))

    def next(self, slot: int) -> list[dict[str, Any] | None]:
        return [self._open().next(slot)]

    def end(self) -> None:
        self._open().end()

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
