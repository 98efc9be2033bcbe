"""A training run through the trainer's published REST API, the first run on the fresh stack: the
trainer (Megatron on gloo) and the rollout manager's engines in two containers sharing IPC and PID
namespaces, weights moving between them through the shared /dev/shm."""

from __future__ import annotations

import pytest
from compose_stack import Stack

RUN_S = 600
"""Bound on a 3-rollout run on two busy cores (Ray, Megatron, the warm-up, three steps)."""


@pytest.mark.timeout(RUN_S + 120)
def test_three_rollouts_end_at_weight_version_4_with_a_checkpoint_on_the_volume(stack: Stack) -> None:
    started = stack.start_run("ci-train", {"num_rollout": 3})
    assert (started["state"], started["num_rollout"]) == ("running", 3)
    done = stack.wait_run("ci-train", lambda s: s["state"] != "running", RUN_S, "finished")
    assert done["state"] == "finished", done
    # Seed: version 1 is pushed before rollout 0, each of the 3 rollouts pushes one more.
    assert (done["steps_done"], done["rollout_id"], done["weight_version"]) == (3, 2, 4)
    assert done["last_step"]["weight_version"] == 4
    assert done["checkpoint"] == "/checkpoints/ci-train/rollout_0000002"
    assert stack.checkpoints("ci-train") == [2]
    # The engines serve the last weights: the rollout manager reports version 4.
    status, engines = stack.call("http://rollout:18083/v1/engines")
    assert status == 200 and engines["weight_version"] == 4, engines
