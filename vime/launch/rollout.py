"""``vime rollout``: one rollout against a running stack, its samples printed or saved as JSONL.

The rollout manager generates, scores and publishes the batch as for training (seed steps
14–32); the samples are then read back, without consuming them, from the batch's per-rank blobs
in Redis and decoded with the model's tokenizer. So this needs the stack's resolved config
(``runs/<run_id>/config.yaml``: run id and Redis URL), which ``runs/latest`` points at.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from vime.batch import SampleRow, decode_rank_batch
from vime.clients.rollout import RolloutClient
from vime.config import RunConfig
from vime.models.path import policy_model_path
from vime.queue import blob_prefix
from vime.wire.rollout import RolloutJob


class RolloutCommandError(RuntimeError):
    """The stack cannot give samples back (no Redis URL, no batch)."""


async def read_samples(cfg: RunConfig, job: RolloutJob) -> list[dict[str, Any]]:
    """Every sample of the job's batch, in batch order, with prompt and response token ids."""
    if cfg.services.redis_url is None:
        raise RolloutCommandError("no Redis URL in the config: pass the stack's runs/<run_id>/config.yaml")
    if job.batch_id is None or job.run_id is None:
        raise RolloutCommandError(
            f"rollout {job.rollout_id} published no batch: {job.error or 'unknown reason'}"
        )
    r = aioredis.Redis.from_url(cfg.services.redis_url)
    try:
        prefix = blob_prefix(job.run_id, job.batch_id)  # the manager's stream, named in its reply
        rows: list[SampleRow] = []
        for rank in range(job.dp_size or 1):
            blob = await r.get(prefix + str(rank))
            if blob is None:
                raise RolloutCommandError(f"batch {job.batch_id}: no blob for DP rank {rank} in Redis")
            share = decode_rank_batch(blob if isinstance(blob, bytes) else blob.encode())
            rows.extend(share.sample(i) for i in range(share.num_samples))
    finally:
        await r.aclose()
    rows.sort(key=lambda row: (row.group_index, row.index))
    return [
        {
            "group_index": row.group_index,
            "index": row.index,
            "prompt_ids": row.tokens[: row.prompt_length].tolist(),
            "response_ids": row.tokens[row.prompt_length :].tolist(),
            "reward": row.reward,
            "advantage": row.advantage,
            "status": row.status.value,
            "weight_version": row.weight_version,
        }
        for row in rows
    ]


def decode_texts(cfg: RunConfig, samples: list[dict[str, Any]]) -> None:
    """Add ``prompt`` and ``response`` text to each sample, using the model's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(policy_model_path(cfg)))
    for s in samples:
        s["prompt"] = tok.decode(s["prompt_ids"])
        s["response"] = tok.decode(s["response_ids"])


async def one_rollout(cfg: RunConfig, rollout_id: int) -> tuple[RolloutJob, list[dict[str, Any]]]:
    """Run rollout ``rollout_id`` and return its job and samples."""
    client = RolloutClient(cfg.services.url("rollout"), token=cfg.services.token())
    try:
        job = await client.rollout(rollout_id)
    finally:
        await client.aclose()
    return job, await read_samples(cfg, job)


def write_jsonl(samples: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
