"""The run's event log: every action of the driver loop, in order, with its time.

It is how the memory choreography of a colocated step can be checked after the fact (engines
asleep while the trainer trains, engine weights awake before the push, the KV cache last) and
how an operator reads what a run did. Kept in memory (``GET /v1/runs/{id}/events``) and
appended to ``runs/<run_id>/events.jsonl``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from vime.wire.trainer import RunEvent

log = logging.getLogger("vime.trainer.events")


class EventLog:
    """Numbered events since the run started; ``rollout_id`` is set by the loop as it advances."""

    def __init__(self, path: Path | None = None, keep: int = 20_000) -> None:
        self.path = path
        self.keep = keep
        self.events: list[RunEvent] = []
        self.rollout_id: int | None = None
        self._seq = 0
        self._t0 = time.monotonic()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, action: str, **detail: Any) -> RunEvent:
        event = RunEvent(
            seq=self._seq,
            t=round(time.monotonic() - self._t0, 4),
            rollout_id=self.rollout_id,
            action=action,
            detail=detail,
        )
        self._seq += 1
        self.events.append(event)
        del self.events[: -self.keep]
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(event.model_dump(mode="json")) + "\n")
        log.debug("%s %s", action, detail)
        return event

    def since(self, seq: int) -> list[RunEvent]:
        return [e for e in self.events if e.seq >= seq]
