"""A run survives any single fault of the stack, injected by PID inside a rollout: a reference
engine killed (the only one, at weight version > 0; once inside a rollout, once asleep while the
trainer trains), the router service killed (and vllm-router behind it), the reward service stopped
for a while, Redis killed. One stack started by `vime up` (Redis, router with vllm-router and
Caddy, reward, rollout manager with one CPU reference engine, trainer; colocated: the engine sleeps
while the trainer trains) serves every test; each starts its own run over the trainer's REST API,
from rollout 0 on the same rollout manager (a run never gets an earlier run's rollout of the same
id back).

Each run must finish with every rollout trained exactly once: one metrics.jsonl line per rollout,
one trained batch per rollout in the trainer's events, each that rollout's entry in the Redis
stream, nothing left pending there. The stall of each fault is printed (``pytest -s``) and
reported in docs/faults.md: the T_step of the step it landed in and of the next (a fault late in
a rollout holds up the next one) over twice the median of the steps no fault touched.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from test_cli_support import TOKEN, resolved_config, stack_config, start_vime, stop_vime, write_config

from vime import procs
from vime.launch.orphans import descendants
from vime.queue import group_name, stream_key

AUTH = {"Authorization": f"Bearer {TOKEN}"}
STARTUP_S = 280
RUN_S = 420
pytestmark = [pytest.mark.slow, pytest.mark.timeout(STARTUP_S + RUN_S)]  # the first test starts the stack
NUM_ROLLOUT = 6
FAULT_AT = 1
"""The first rollout a fault may land in (after the first push: the engines hold weight version >= 2);
a run's next fault lands two rollouts later at the earliest."""
REWARD_STOP_S = 12.0
STALL_WARNING_S = 3.0


@dataclass
class FaultStack:
    cfg: dict[str, Any]
    child: procs.Child
    mark: str
    trained: dict[str, list[str]] = field(default_factory=dict)
    """Batch ids each finished run trained, in rollout order."""

    @property
    def resolved(self) -> dict[str, Any]:
        return dict(yaml.safe_load(resolved_config(self.cfg).read_text()))

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.cfg['services'][f'{name}_port']}"

    def service_pid(self, module: str) -> int:
        """The PID of a service the launcher started (its direct child)."""
        found = [
            pid
            for pid, cmd in descendants(self.child.pid).items()
            if module in cmd and _parent(pid) == self.child.pid
        ]
        assert len(found) == 1, (module, found)
        return found[0]

    def engine(self) -> dict[str, Any]:
        """The rollout manager's record of the stack's one engine."""
        return dict(httpx.get(self.url("rollout") + "/v1/engines", timeout=30).json()["engines"][0])

    def engine_pid(self) -> int:
        return int(self.engine()["pid"])

    def run_status(self, run_id: str) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url('trainer')}/v1/runs/{run_id}", timeout=30).json())

    def log(self) -> str:
        assert self.child.log_path is not None
        return self.child.log_path.read_text(errors="replace")


def _parent(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return -1


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    work = tmp_path_factory.mktemp("faults")
    cfg = stack_config(
        work,
        num_rollout=NUM_ROLLOUT,
        colocate=True,  # as on a GPU: the engine sleeps while the trainer trains
        engine__health_check_interval_s=1.0,
        reward__stall_warning_s=STALL_WARNING_S,
    )
    mark = uuid.uuid4().hex
    child = start_vime(
        work / "up.log",
        "up",
        "-c",
        str(write_config(work, cfg)),
        mark=mark,
        model_cache=tmp_path_factory.getbasetemp() / "models",
    )
    st = FaultStack(cfg, child, mark)
    try:
        deadline = time.monotonic() + STARTUP_S
        while "is up" not in st.log():
            assert child.alive() and time.monotonic() < deadline, child.log_tail(60)
            time.sleep(0.5)
        yield st
    finally:
        stop_vime(child, mark)


# --- one run with one fault ------------------------------------------------------------------------


@dataclass
class FaultRun:
    run_id: str
    status: dict[str, Any]
    rows: list[dict[str, Any]]
    events: list[dict[str, Any]]
    landed: list[int]
    """The rollout each fault was injected in."""

    def stall_s(self, rollout_id: int) -> float:
        """The T_step of that step and the next over twice the median of the steps no fault
        touched (rollout 0, with its first-call costs, left out)."""
        t = {r["rollout_id"]: r["perf/T_step"] for r in self.rows}
        touched = {k + d for k in self.landed for d in (0, 1)}
        calm = [v for k, v in t.items() if k not in touched and k > 0]
        return float(t[rollout_id] + t.get(rollout_id + 1, 0.0) - 2 * statistics.median(calm))


Inject = Callable[[dict[str, Any]], bool]


def run_with_faults(stack: FaultStack, name: str, **faults: Inject) -> FaultRun:
    """Start a run; once it is in the rollout phase of `FAULT_AT` or later, call each fault's
    ``inject(status)`` in turn, each two rollouts after the one before at the earliest, until it
    returns True (it injected); wait for the run to end and check it trained every rollout exactly
    once."""
    run_id = f"{name}-{uuid.uuid4().hex[:6]}"
    r = httpx.post(stack.url("trainer") + "/v1/runs", json={"run_id": run_id}, headers=AUTH, timeout=60)
    assert r.status_code == 201, r.text
    deadline = time.monotonic() + RUN_S
    injects = list(faults.values())
    landed: list[int] = []
    while True:
        status = stack.run_status(run_id)
        assert time.monotonic() < deadline, (
            f"run {run_id} not done after {RUN_S}s: {status}\n{stack.log()[-4000:]}"
        )
        if status["state"] not in ("running", "stopping"):
            break
        at, i = status["rollout_id"], len(landed)
        due = i < len(injects) and at is not None and at >= FAULT_AT + 2 * i and at not in landed
        if due and status["phase"] == "rollout" and injects[i](status):
            landed.append(at)
        time.sleep(0.02 if len(landed) < len(injects) else 0.5)
    assert len(landed) == len(injects), f"faults landed in rollouts {landed} only, of run {run_id}"
    assert status["state"] == "finished", (status, stack.log()[-4000:])
    run_dir = Path(stack.cfg["output_dir"]) / run_id
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    run = FaultRun(run_id, status, rows, events, landed)
    for fault, rollout_id in zip(faults, landed, strict=True):
        print(
            f"\nFAULT {fault}: in rollout {rollout_id} of {NUM_ROLLOUT}; stall {run.stall_s(rollout_id):.1f} s "
            f"(T_step {[round(r['perf/T_step'], 1) for r in rows]}); outcome: {status['state']}, "
            f"{status['steps_done']} steps"
        )
    check_trained_exactly_once(stack, run)
    return run


def check_trained_exactly_once(stack: FaultStack, run: FaultRun) -> None:
    """Each rollout of the run: one metrics line, one trained batch (its own, in Redis), none pending."""
    assert [r["rollout_id"] for r in run.rows] == list(range(NUM_ROLLOUT))
    trained = [e["detail"]["batch_id"] for e in run.events if e["action"] == "trainer.train"]
    assert len(trained) == NUM_ROLLOUT == len(set(trained)), trained
    resolved = stack.resolved
    r = redis.Redis.from_url(resolved["services"]["redis_url"], decode_responses=True)
    try:
        stream = stream_key(resolved["run_id"])  # the rollout manager's run id names the stream
        rollout_of = {f["batch_id"]: int(f["rollout_id"]) for _, f in r.xrange(stream)}
        assert [rollout_of[b] for b in trained] == list(range(NUM_ROLLOUT))
        assert r.xpending(stream, group_name(0))["pending"] == 0
    finally:
        r.close()
    for other, batches in stack.trained.items():  # an earlier run's batch is never handed to this one
        assert not set(batches) & set(trained), (other, run.run_id)
    stack.trained[run.run_id] = trained


# --- the faults ---------------------------------------------------------------------------------


def test_the_only_engine_killed_inside_a_rollout_is_restarted_and_caught_up(stack: FaultStack) -> None:
    """The engine is frozen first, and killed only if the rollout is then still running (its
    requests wait on the frozen engine), so the kill lands inside the rollout. The rollout manager
    restarts it; it comes back needing weights (version > 0), and the trainer pushes them while the
    rollout waits for it (with one engine nothing else serves)."""
    killed: list[int] = []

    def kill_engine(status: dict[str, Any]) -> bool:
        pid = stack.engine_pid()
        os.kill(pid, signal.SIGSTOP)
        health = httpx.get(stack.url("rollout") + "/health", timeout=30).json()
        now = stack.run_status(status["run_id"])
        if health["rollout_running"] is None or now["phase"] != "rollout":
            os.kill(pid, signal.SIGCONT)  # the rollout was done already: try the next one
            return False
        os.killpg(pid, signal.SIGKILL)
        killed.append(pid)
        return True

    run = run_with_faults(stack, "engine", engine_killed=kill_engine)
    engine = stack.engine()
    assert engine["restarts"] >= 1 and engine["pid"] != killed[0]
    assert engine["status"] == "ready" and engine["weight_version"] == run.status["weight_version"]
    loaded = [(e["rollout_id"], e["detail"]) for e in run.events if e["action"] == "weights.loaded"]
    # One catch-up push brought the restarted engine the version: in the faulted rollout, or in the
    # next when the kill came after the last generate returned. A push that found the engine gone
    # (killed, not yet seen dead) loaded nothing and does not count.
    catch_ups = [at for at, d in loaded if d["catch_up"] and d["engines"]]
    assert len(catch_ups) == 1 and catch_ups[0] in (run.landed[0], run.landed[0] + 1), loaded


def test_the_only_engine_killed_while_the_engines_sleep_is_restarted_after_the_training(
    stack: FaultStack,
) -> None:
    """Killed while the trainer trains (the engine asleep, its memory the trainer's): the paused
    health monitor marks it dead and holds its restart until the engines' wake; the push after the
    training goes on without it; the restarted engine is caught up before the next rollout uses
    it. The training ranks are frozen from inside the rollout until the kill is seen, so the kill
    lands while the engine sleeps (a CPU step trains in a fraction of a second)."""
    killed: list[int] = []

    def kill_asleep_engine(status: dict[str, Any]) -> bool:
        trainer = stack.service_pid("vime_trainer")
        ranks = [pid for pid, cmd in descendants(trainer).items() if "RankActor" in cmd]
        assert ranks, descendants(trainer)
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while not stack.engine()["asleep"] or stack.run_status(status["run_id"])["phase"] == "rollout":
                assert time.monotonic() < deadline, (stack.engine(), stack.run_status(status["run_id"]))
                time.sleep(0.05)
            pid = int(stack.engine()["pid"])
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
            while (state := stack.engine()["status"]) == "ready":  # the paused monitor sees the exit
                assert time.monotonic() < deadline, state
                time.sleep(0.1)
            assert state == "dead", state  # not restarted while the trainer may hold its memory
        finally:
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
        return True

    run = run_with_faults(stack, "asleep", engine_killed=kill_asleep_engine)
    now = stack.engine()
    assert now["restarts"] >= 1 and now["pid"] != killed[0]
    assert now["status"] == "ready" and now["weight_version"] == run.status["weight_version"]


def test_the_router_service_and_vllm_router_killed_mid_run(stack: FaultStack) -> None:
    """vllm-router is killed in one rollout (the router service restarts it), the router service
    itself in a later one (the launcher restarts it; the rollout manager registers the engine
    again); the generates wait for the router in both."""

    def kill_vllm_router(status: dict[str, Any]) -> bool:
        dp = httpx.get(stack.url("router_control") + "/v1/data-plane", headers=AUTH, timeout=30).json()
        os.kill(dp["router_pid"], signal.SIGKILL)
        return True

    def kill_router(status: dict[str, Any]) -> bool:
        os.kill(stack.service_pid("vime_router"), signal.SIGKILL)
        return True

    run_with_faults(stack, "router", vllm_router_killed=kill_vllm_router, router_service_killed=kill_router)
    log = stack.log()
    assert "↻ router exited with code -9; restarting it" in log and "router   back after" in log
    health = httpx.get(stack.url("router_control") + "/health", timeout=30).json()
    assert health["routable_engines"] == 1 and "router_url" not in health["data_plane"]


def test_the_reward_service_stopped_for_a_while_is_named_and_waited_for(stack: FaultStack) -> None:
    pid = stack.service_pid("vime_reward")

    def stop_reward(status: dict[str, Any]) -> bool:
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(REWARD_STOP_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        return True

    run = run_with_faults(stack, "reward", reward_stopped=stop_reward)
    log = stack.log()
    assert "reward service stalled" in log and "reward service answered again after a" in log
    assert run.stall_s(run.landed[0]) > STALL_WARNING_S  # the step waited for the service, it did not fail


def test_redis_killed_is_restarted_with_its_data_and_the_run_goes_on(stack: FaultStack) -> None:
    resolved = stack.resolved
    stream = stream_key(resolved["run_id"])
    r = redis.Redis.from_url(resolved["services"]["redis_url"])
    before = r.xlen(stream)
    r.close()

    def kill_redis(status: dict[str, Any]) -> bool:
        os.kill(stack.service_pid("redis-server"), signal.SIGKILL)
        return True

    run_with_faults(stack, "redis", redis_killed=kill_redis)
    assert "↻ redis exited with code -9; restarting it" in stack.log()
    r = redis.Redis.from_url(resolved["services"]["redis_url"])
    try:  # the earlier runs' entries came back from the append-only file
        assert r.xlen(stream) >= before + NUM_ROLLOUT
    finally:
        r.close()
