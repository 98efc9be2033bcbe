"""Faults a user of the compose stack meets: a container killed mid-run, `docker compose down` and
`up` in the middle of a run, Redis dying with a batch nobody acked. Each test leaves the stack up
and healthy again, the way its user would bring it back.

The runs here start at rollout ids no earlier test used (`start_rollout_id`): the rollout manager
answers a repeated rollout id with the job it already ran (a retry of the same run), so a second
run from rollout 0 on the same rollout manager would wait for batches the first run consumed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from compose_stack import UP_TIMEOUT_S, Stack

from vime.queue import blob_prefix, group_name, stream_key

RUN_S = 600
OUTCOME_S = 180
"""Bound within which the user learns what became of the run after the kill."""


def _progressed(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda s: s["steps_done"] >= n


def _after_kill(stack: Stack, run_id: str, steps_before: int) -> str:
    """What the user sees, polled until it is one of the bounded outcomes (else the test fails)."""
    deadline, last = time.monotonic() + OUTCOME_S, "nothing yet"
    while time.monotonic() < deadline:
        try:
            status = stack.trainer("GET", f"/v1/runs/{run_id}").json()
        except httpx.TransportError as exc:
            trainer = stack.containers()["trainer-cpu"]
            if trainer["State"] != "running":
                return (
                    f"trainer API unreachable ({type(exc).__name__}), trainer container {trainer['Status']}"
                )
            last = f"trainer API unreachable ({exc}) but its container is {trainer['Status']}"
        else:
            if status.get("state") == "failed":
                assert status["error"], status
                return f"run failed: {status['error']}"
            if status.get("steps_done", 0) >= steps_before + 2:
                return "run continued"
            last = f"run {status.get('state')} at step {status.get('steps_done')}"
        time.sleep(2)
    raise AssertionError(f"no outcome {OUTCOME_S} s after the kill: {last}\n{stack.logs('trainer-cpu')}")


@pytest.mark.timeout(RUN_S + OUTCOME_S + UP_TIMEOUT_S + 120)
def test_docker_kill_of_the_rollout_container_mid_run_ends_in_a_bounded_outcome(stack: Stack) -> None:
    """`docker kill` is a manual stop: the restart policy leaves the rollout container down. The
    trainer shares its PID namespace, so it dies with it, and Docker's one attempt to restart it
    fails (the namespace it must join is gone). The user sees the trainer's port refuse at once,
    never a hanging run; `docker compose up -d` brings the pair back, without the lost run."""
    stack.start_run("ci-kill", {"num_rollout": 100, "save_interval": 1, "start_rollout_id": 10})
    before = stack.wait_run(  # an interval checkpoint counts once the next step is about to train
        "ci-kill", lambda s: s["steps_done"] >= 1 and s["checkpoint"], RUN_S, "past a checkpoint"
    )
    stack.compose("kill", "-s", "SIGKILL", "rollout-cpu")
    outcome = _after_kill(stack, "ci-kill", before["steps_done"])
    containers = stack.containers()
    assert containers["rollout-cpu"]["State"] == "exited", containers["rollout-cpu"]["Status"]
    print(f"after docker kill of rollout-cpu: {outcome}; trainer-cpu {containers['trainer-cpu']['Status']}")
    stack.up()
    assert {c["Health"] for c in stack.containers().values()} == {"healthy"}
    if outcome.startswith("trainer API unreachable"):
        assert stack.trainer("GET", "/v1/runs/ci-kill").status_code == 404
    assert stack.checkpoints("ci-kill"), "the run's checkpoints are on the volume"


@pytest.mark.timeout(2 * RUN_S + 2 * UP_TIMEOUT_S)
def test_down_then_up_resumes_the_run_from_its_checkpoint_on_the_volume(stack: Stack) -> None:
    stack.start_run("ci-resume", {"num_rollout": 100, "save_interval": 1, "start_rollout_id": 20})
    before = stack.wait_run("ci-resume", _progressed(2), RUN_S, "past two steps")
    stack.compose("down", timeout=120)  # volumes kept
    assert not stack.containers()
    stack.up()
    saved = stack.checkpoints("ci-resume")
    assert saved and saved[-1] >= 20 + before["steps_done"] - 1, saved
    resume_at = saved[-1] + 1
    # The same run id resumes its own checkpoints: one more rollout, then the run ends.
    started = stack.start_run("ci-resume", {"num_rollout": resume_at + 1, "save_interval": 1})
    assert started["state"] == "running"
    done = stack.wait_run("ci-resume", lambda s: s["state"] != "running", RUN_S, "finished")
    assert done["state"] == "finished", done
    assert (done["start_rollout_id"], done["rollout_id"], done["steps_done"]) == (resume_at, resume_at, 1)
    events = stack.trainer("GET", "/v1/runs/ci-resume/events").json()["events"]
    resumed = [e["detail"] for e in events if e["action"] == "run.resume"]
    assert resumed and resumed[-1]["next_rollout_id"] == resume_at, resumed
    # The checkpoint's weights are republished under their version; the step pushes the next one.
    assert done["weight_version"] == resumed[-1]["weight_version"] + 1
    assert stack.checkpoints("ci-resume")[-1] == resume_at


def _groups(raw: str) -> list[tuple[str, str, str]]:
    """(name, pending, last-delivered-id) of each group in `XINFO GROUPS` raw output. Redis does
    not persist entries-read and lag (they come back unknown after a restart), so they are left out."""
    lines, groups = raw.splitlines(), []
    fields: dict[str, str] = {}
    for key, value in zip(lines[::2], lines[1::2], strict=False):
        if key == "name" and fields:
            groups.append(fields)
            fields = {}
        fields[key] = value
    groups.append(fields)
    return sorted((g["name"], g["pending"], g["last-delivered-id"]) for g in groups if g)


@pytest.mark.timeout(RUN_S + UP_TIMEOUT_S)
def test_a_batch_nobody_acked_survives_redis_dying(stack: Stack) -> None:
    """A training rollout published with no run to read it, one entry read and left unacked by a
    consumer; then Redis is SIGKILLed (no shutdown save: only the AOF on the volume can keep it)
    and brought back with `up`."""
    rollout = "http://rollout:18083"
    for path, body in (("/v1/admission/resume", {"was_paused": False}), ("/v1/engines/onload", {})):
        status, reply = stack.call(rollout + path, "POST", body)
        assert status == 200, reply
    status, job = stack.call(f"{rollout}/v1/rollouts", "POST", {"rollout_id": 900})
    assert status == 200 and job["batch_id"] and job["entry_id"], job
    stream, entry, batch_id = stream_key(job["run_id"]), job["entry_id"], job["batch_id"]
    stack.redis("XGROUP", "CREATE", stream, "ci-probe", "0")
    stack.redis("XREADGROUP", "GROUP", "ci-probe", "reader", "COUNT", "100000", "STREAMS", stream, ">")

    def state() -> tuple[str, str, str, list[tuple[str, str, str]]]:
        return (
            stack.redis("XRANGE", stream, entry, entry),
            stack.redis("XPENDING", stream, "ci-probe"),
            stack.redis("STRLEN", blob_prefix(job["run_id"], batch_id) + "0"),
            _groups(stack.redis("XINFO", "GROUPS", stream)),
        )

    before = state()
    assert batch_id in before[0] and entry in before[1] and int(before[2]) > 0, before
    assert group_name(0) in {g[0] for g in before[3]}
    time.sleep(2)  # appendfsync everysec
    stack.compose("kill", "-s", "SIGKILL", "redis")
    assert stack.containers()["redis"]["State"] == "exited"
    stack.up()
    assert state() == before
