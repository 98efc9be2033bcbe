"""The trainer's run events as the loop tests compare them: the seed's order of a step's actions
and the names a list of events boils down to (shared by the in-process and the REST loop tests)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

PUSH = [
    "weights.push",
    "weights.pause",
    "weights.flush",
    "weights.start",
    "weights.update",
    "weights.finish",
    "weights.resume",
    "weights.loaded",
]
"""One weight push (seed steps 4–8, 46–52); ``weights.update`` stands for all of its buckets."""
TRAIN = ["rollout.start", "rollout.done", "engines.offload", "trainer.wake_up", "trainer.train"]
"""A step up to its training (seed steps 14–40)."""
TRAINED = ["trainer.sleep", "rollout.training_completed"]
"""Seed steps 41–42, after the step's checkpoint when it has one ([*TRAIN, *SAVE, *TRAINED])."""
SAVE = ["trainer.save", "trainer.saved"]
"""A checkpoint complete before the loop goes on (a background one's ``trainer.saved`` comes later)."""
STEP = [*TRAIN, *TRAINED]
"""A step without a checkpoint up to its weight sync (seed steps 14–42)."""
DROP = "trainer.drop_weights"
"""The end of seed step 41: the weights the trainer's sleep kept on the GPU leave after the push."""
SYNC = ["engines.onload(weights)", "admission.pause", *PUSH, DROP]
"""A step's weight sync (seed steps 43–52)."""


def action_names(events: Iterable[Mapping[str, Any]]) -> list[str]:
    """Each event's action, as ``action(tag,...)`` when it carries tags; a run of ``weights.update``
    (one per bucket, however many there are) counts once."""
    out: list[str] = []
    for e in events:
        name = e["action"] + (f"({','.join(e['detail']['tags'])})" if "tags" in e["detail"] else "")
        if not out or not (name == out[-1] == "weights.update"):
            out.append(name)
    return out
