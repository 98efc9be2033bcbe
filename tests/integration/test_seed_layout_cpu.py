"""The seed scenario's layout on CPU: Megatron TP=2 × DP=4 (8 gloo ranks as Ray actors), four
reference engines behind the router, 32 prompts × 8 samples, micro-batch 8, one step per rollout.

The 8-GPU run itself needs a machine this project is not lent; this is the same code path with
the seed's numbers, through `vime train` as a user runs it: 4 engines serving ~64 requests each,
each DP rank training 64 samples in 8 micro-batches, weight versions 1 → 2 → 3 → 4."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from test_cli_support import stack_config, start_vime, stop_vime, wait_exit, write_config

from vime import procs


@pytest.mark.timeout(600)
def test_seed_layout_tp2_dp4_four_engines(tmp_path: Path) -> None:
    cfg = stack_config(
        tmp_path,
        num_rollout=3,
        rollout_batch_size=32,
        n_samples_per_prompt=8,
        micro_batch_size=8,
        rollout_num_engines_cpu=4,
        actor_num_cpu_ranks=8,
        tensor_model_parallel_size=2,
        engine__base_port=procs.free_port_run(4),
    )
    mark = uuid.uuid4().hex
    child = start_vime(
        tmp_path / "train.log",
        "train",
        "-c",
        str(write_config(tmp_path, cfg)),
        mark=mark,
        model_cache=tmp_path,
    )
    try:
        assert wait_exit(child, 540) == 0, child.log_tail(80)
    finally:
        stop_vime(child, mark)
    run_dir = Path(cfg["output_dir"]) / cfg["run_id"]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    start = next(e["detail"] for e in events if e["action"] == "trainer.start")
    assert start == {"dp_size": 4, "world_size": 8}
    assert next(e["detail"]["engines"] for e in events if e["action"] == "rollout.ready") == 4
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for k, r in enumerate(rows):
        assert (r["batch/weight_version_min"], r["batch/weight_version_max"], r["weight_version"]) == (
            k + 1,
            k + 1,
            k + 2,
        )
        assert r["rollout/requests"] == r["batch/samples"] == 256
        assert r["rollout/engines_reporting"] == 4  # every engine served through the router
        assert r["rollout/engine_requests_min"] == r["rollout/engine_requests_max"] == 64  # round robin
        assert (r["batch/dp_ranks"], r["batch/rank_samples_min"], r["batch/rank_samples_max"]) == (4, 64, 64)
        assert r["batch/rank_micro_batches_min"] == r["batch/rank_micro_batches_max"] == 8
        assert r["train/optimizer_steps"] == 1
