"""The whole loop over REST on CPU: Redis, the router service, the reward service, the rollout manager
with two reference engines, and the trainer service (Megatron ranks as Ray actors over gloo), all
real processes. A run is started with ``POST /v1/runs``, stopped after its first step, and resumed.

Checked, per the seed: weight versions 1 → 2 → 3 (→ 4) reported by the engines and carried by the
samples of rollouts 0, 1, 2; the engines generating with the new weights; every step's actions in
the seed's order (engines asleep while the trainer trains, engine weights awake before the push,
the KV cache last) and the engines' own sleep states only moving that way; the timings; the stop
checkpointing and the resume continuing at the next rollout id, with the data position restored;
an engine killed between the two legs receiving the weights before it serves again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_trainer_support import (
    AUTH,
    EngineWatch,
    Stack,
    actions,
    call,
    check_engine_states,
    check_step_order,
    probe,
    run_events,
    safe_engines,
    start_stack,
    stop_children,
    wait_first_step,
)

from tests.support.run_events import DROP, PUSH
from vime.wire.trainer import STEP_PHASES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Trainer ranks at TP=2 (the one-rank loop runs in the launcher, fault and async tests)."""
    tp = 2
    st = start_stack(
        tmp_path_factory.mktemp(f"trainer-it-tp{tp}"),
        redis_url,
        tp,
        tmp_path_factory.getbasetemp() / "models",
    )
    pids: list[int] = []
    try:
        pids = [e["pid"] for e in st.engines()]
        yield st
    finally:
        pids += [e["pid"] for e in safe_engines(st)]
        stop_children(st.children, pids)


def test_run_stop_and_resume_over_rest(stack: Stack) -> None:
    run_id = stack.cfg["run_id"]
    urls = [e["url"] for e in stack.engines()]
    assert all(set(e["asleep"]) == {"weights", "kv_cache"} for e in stack.engines())  # colocated start
    k, probe_a = leg_a_stops_during_its_first_steps(stack, run_id, urls)
    engine_dies_between_legs(stack)
    leg_b_resumes_at_the_next_rollout(stack, run_id, urls, k)
    versions_and_record(stack, run_id, urls)
    probe_b = probe(urls[0])
    assert probe_b != probe_a and probe(urls[1]) == probe_b  # the engines generate with the new weights


def test_sft_warm_up_before_the_first_push(stack: Stack) -> None:
    """A fresh run warms up on the labels (the sums) before it pushes: the loss goes down, and every
    warm-up step is recorded apart from the RL steps and shown to the CLI as ``sft.*`` events."""
    run_id = f"{stack.cfg['run_id']}-sft"
    config = {"num_rollout": 1, "trainer": {"sft_warmup_steps": 4}}
    asyncio.run(call(stack, lambda c: c.start_run(config, run_id=run_id)))
    done = asyncio.run(call(stack, lambda c: c.wait_run(run_id, timeout_s=600, poll_s=0.5)))
    assert done.state == "finished", done.error
    got = actions(run_events(stack, run_id), None)
    start = got.index("trainer.load")
    assert got[start : start + 8] == [
        "trainer.load",
        "sft.start",
        *["sft.step"] * 4,
        "sft.done",
        "trainer.sleep",
    ]
    assert got.index("sft.done") < got.index("weights.push")  # the first push carries the warmed-up weights
    run_dir = stack.work / "runs" / run_id
    warm = [json.loads(x) for x in (run_dir / "warmup.jsonl").read_text().splitlines()]
    assert [w["sft_step"] for w in warm] == [0, 1, 2, 3]
    losses = [w["sft/loss"] for w in warm]
    assert losses[-1] < losses[0] - 0.1 and all(w["sft/optimizer_steps"] == 1.0 for w in warm), losses
    summary = done.summary or {}
    assert summary["sft_steps"] == 4 and summary["sft_loss_last"] < summary["sft_loss_first"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0]  # one line per RL step: the warm-up is not in it


def leg_a_stops_during_its_first_steps(stack: Stack, run_id: str, urls: list[str]) -> tuple[int, object]:
    """Start over REST, stop as soon as the loop is past start-up; returns the step it stopped after."""
    with EngineWatch(urls) as watch:
        started = asyncio.run(call(stack, lambda c: c.start_run(run_id=run_id)))
        assert started.state == "running" and started.num_rollout == 3
        dup = httpx.post(stack.trainer_url + "/v1/runs", json={"run_id": "other"}, headers=AUTH)
        assert dup.status_code == 409
        wait_first_step(stack, run_id)
        assert httpx.post(f"{stack.trainer_url}/v1/runs/{run_id}/stop", headers=AUTH).status_code == 202
        a = asyncio.run(call(stack, lambda c: c.wait_run(run_id, timeout_s=600, poll_s=0.5)))
    assert a.state == "stopped", a.error
    k = (a.next_rollout_id or 0) - 1  # the step the stop landed in: 0, or 1 when the poll was slow
    assert k in (0, 1) and (a.start_rollout_id, a.steps_done) == (0, k + 1)
    assert a.checkpoint and (Path(a.checkpoint) / "vime_state.json").is_file()
    saved = json.loads((Path(a.checkpoint) / "vime_state.json").read_text())
    assert saved["next_rollout_id"] == k + 1 and saved["run_state"]["weight_version"] == k + 2
    assert saved["run_state"]["data_state"]["sample_group_index"] == 2 * (k + 1)  # 2 prompts a rollout
    assert a.weight_version == k + 2 and a.last_step is not None
    t = a.last_step.timings
    parts = [getattr(t, f"{p}_s") for p in STEP_PHASES]
    assert all(p > 0 for p in parts) and t.step_s == pytest.approx(sum(parts))
    m = a.last_step.metrics
    assert m["batch/weight_version_min"] == m["batch/weight_version_max"] == k + 1
    events = run_events(stack, run_id)
    assert actions(events, None) == [
        "run.start",
        "rollout.ready",
        "trainer.start",
        "trainer.load",
        "trainer.sleep",  # 1–3
        "engines.onload(weights)",
        *PUSH,
        DROP,
        "rollout.training_ready",  # 4–9
        "engines.onload(kv_cache)",  # 10–13
    ]
    for rollout_id in range(k):
        check_step_order(events, rollout_id, saved="no")
    check_step_order(events, k, saved="either")  # the stop came during step k
    check_engine_states(watch)
    assert [v for _, v in watch.seen[urls[0]] if v is not None][-1] == str(k + 2)
    probe_a = probe(urls[0])
    assert probe(urls[0]) == probe_a and probe(urls[1]) == probe_a  # the same weights everywhere
    return k, probe_a


def engine_dies_between_legs(stack: Stack) -> None:
    """The rollout manager restarts it; it waits, out of the router, for weights."""
    os.kill(stack.engines()[1]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and stack.engines()[1]["status"] != "needs_weights":
        time.sleep(0.5)
    assert stack.engines()[1]["status"] == "needs_weights"


def leg_b_resumes_at_the_next_rollout(stack: Stack, run_id: str, urls: list[str], k: int) -> None:
    with EngineWatch(urls) as watch:
        asyncio.run(call(stack, lambda c: c.start_run(run_id=run_id)))
        b = asyncio.run(call(stack, lambda c: c.wait_run(run_id, timeout_s=900, poll_s=0.5)))
    assert b.state == "finished", b.error
    assert (b.start_rollout_id, b.steps_done, b.next_rollout_id, b.weight_version) == (k + 1, 2 - k, 3, 4)
    events = run_events(stack, run_id)
    assert [a for a in actions(events, None) if a == "run.resume"] == ["run.resume"]
    for rollout_id in range(k + 1, 2):
        check_step_order(events, rollout_id, saved="no")
    check_step_order(events, 2, saved="after_train")  # the last rollout
    check_engine_states(watch)
    summary = b.summary or {}
    assert summary["steps"] == 3 and summary["weight_version"] == 4 and summary["first_rollout_id"] == 0
    assert Path(summary["report"]).read_bytes()[:4] == b"\x89PNG"
    state = httpx.get(stack.rollout_url + "/v1/data-source/state", timeout=10).json()["state"]
    assert state["sample_group_index"] == 6  # 3 rollouts × 2 prompts: none drawn twice, none skipped


def versions_and_record(stack: Stack, run_id: str, urls: list[str]) -> None:
    """Reported by the engines (the restarted one included) and carried by the samples."""
    for url in urls:
        assert httpx.get(url + "/weight_info", timeout=10).json()["weight_version"] == "4"
    engines = stack.engines()
    assert all(e["status"] == "ready" and e["registered"] and e["weight_version"] == 4 for e in engines)
    rows = [json.loads(x) for x in (stack.work / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    versions = [(r["batch/weight_version_min"], r["batch/weight_version_max"]) for r in rows]
    assert versions == [(1, 1), (2, 2), (3, 3)]
    assert [r["weight_version"] for r in rows] == [2, 3, 4]
    assert all(r["perf/T_step"] == pytest.approx(sum(r[f"perf/T_{p}"] for p in STEP_PHASES)) for r in rows)
    assert not list((stack.work / "shm").glob("*.safetensors"))  # every bucket file was deleted
