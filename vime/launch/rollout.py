"""``vime rollout``: one rollout against a running stack, its samples printed or saved as JSONL.

The rollout manager generates and scores the rollout as for training (seed steps 14–30) but
publishes nothing (``"publish": false``): the samples, decoded and with the advantages they would
have trained with, come back in its reply, and the data source's position is left where it was.
So nothing reaches Redis and a run started later on the stack neither trains on this rollout nor
skips its prompts. It needs only the rollout manager's URL and token from the stack's config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vime.clients.rollout import RolloutClient
from vime.config import RunConfig
from vime.wire.rollout import RolloutJob


class RolloutCommandError(RuntimeError):
    """The rollout manager gave no samples back."""


async def one_rollout(cfg: RunConfig, rollout_id: int) -> tuple[RolloutJob, list[dict[str, Any]]]:
    """Roll out ``rollout_id`` without publishing it; the job and its samples (groups in order)."""
    client = RolloutClient(cfg.services.url("rollout"), token=cfg.services.token())
    try:
        job = await client.rollout(rollout_id, publish=False)
    finally:
        await client.aclose()
    if job.samples is None:
        raise RolloutCommandError(
            f"rollout {rollout_id}: the rollout manager sent no samples back ({job.error or 'no reason given'})"
        )
    return job, [s.model_dump(mode="json") for s in job.samples]


def write_jsonl(samples: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
