"""The async mode on CPU, over REST with real processes: the embedded default (examples/cpu.yaml: the
tiny arithmetic task after its supervised warm-up) with ``mode: async``, one run stopped after a
few steps and resumed to the end.

Checked: the reward rises (first steps' mean against the last steps'); every trained batch lies
within ``max_staleness`` of the trainer's version, computed from the versions the samples carried;
no sample is trained twice or lost: every batch on the run's Redis stream was trained once (the
ranks' trained set, one metrics line each) or dropped (the run's dropped set, disjoint), one batch
per rollout id, and the data source handed out each published rollout's prompts once (the stop's
rollout under way gave its prompts back); a run asking for the mode the stack was not started in is
a 409.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from tests.support.rollout_stack import start_rollout_services
from vime import procs
from vime.clients.trainer import TrainerClient
from vime.queue import dropped_key, stream_key, trained_key
from vime.wire.rollout import PRODUCER_NEXT_KEY

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TOKEN = "it-async-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NUM_ROLLOUT = 20
STOP_AFTER = 6
"""Leg A is stopped once this many steps are done."""
EDGE = 5
"""Steps whose reward means are compared at each end of the run."""


def async_config(work: Path, redis_url: str) -> dict[str, Any]:
    cfg = yaml.safe_load((REPO / "examples" / "cpu.yaml").read_text())
    ports = {n: procs.free_port() for n in ("router", "router_control", "reward", "rollout", "trainer")}
    cfg.update(
        run_id=f"it-async-{uuid.uuid4().hex[:6]}",
        output_dir=str(work / "runs"),
        num_rollout=NUM_ROLLOUT,
        eval_interval=None,
        mode="async",
        max_staleness=1,
    )
    cfg["trainer"].update(checkpoint_dir=str(work / "ckpt"), weight_dir=str(work / "shm"))
    cfg["engine"].update(base_port=procs.free_port_run(), startup_timeout_s=240)
    cfg["services"] = {
        "host": "127.0.0.1",
        **{f"{k}_port": v for k, v in ports.items()},
        "redis_url": redis_url,
        "api_token": TOKEN,
    }
    return cfg


async def _trainer(url: str, fn: Any) -> Any:
    async with TrainerClient(url, token=TOKEN) as client:
        return await fn(client)


@pytest.mark.timeout(900)  # the embedded default's warm-up is most of it: ~4 min on 2 quiet cores
def test_async_run_learns_within_the_bound_and_a_resume_loses_nothing(
    redis_url: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cfg = async_config(tmp_path, redis_url)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    s, logs = cfg["services"], tmp_path / "logs"
    env = {"VIME_MODEL_CACHE": str(tmp_path_factory.getbasetemp() / "models")}
    children: list[procs.Child] = []
    try:
        rollout_url = start_rollout_services(cfg_path, s, logs, children, manager_env=env)
        trainer = procs.start(
            "trainer",
            procs.python_module("vime_trainer", "--config", str(cfg_path)),
            log_path=logs / "trainer.log",
            env=env,
        )
        children.append(trainer)
        trainer_url = f"http://127.0.0.1:{s['trainer_port']}"
        procs.wait_healthy(trainer_url, trainer, timeout_s=120)
        run_id = cfg["run_id"]
        refused = httpx.post(
            trainer_url + "/v1/runs",
            json={"run_id": "x", "config": {"mode": "sync"}},
            headers=AUTH,
            timeout=30,
        )
        assert refused.status_code == 409 and "started with mode=async" in refused.text
        a = leg(trainer_url, run_id, stop_after=STOP_AFTER)
        assert a.state == "stopped" and a.mode == "async" and STOP_AFTER <= a.steps_done < NUM_ROLLOUT, a
        b = leg(trainer_url, run_id)
        assert b.state == "finished", b.error
        assert b.start_rollout_id == a.next_rollout_id  # the resume starts after what leg A consumed
        check_record(tmp_path / "runs" / run_id, a.steps_done)
        check_redis(redis_url, run_id, tmp_path / "runs" / run_id, rollout_url, cfg["rollout_batch_size"])
    finally:
        for child in reversed(children):
            child.stop(grace_s=30)


def leg(trainer_url: str, run_id: str, stop_after: int | None = None) -> Any:
    """One run leg over REST: started (or resumed), stopped once ``stop_after`` steps are done."""
    asyncio.run(_trainer(trainer_url, lambda c: c.start_run(run_id=run_id)))
    if stop_after is not None:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            st = httpx.get(f"{trainer_url}/v1/runs/{run_id}", timeout=10).json()
            assert st["state"] == "running", st
            if st["steps_done"] >= stop_after:
                break
            time.sleep(0.2)
        assert httpx.post(f"{trainer_url}/v1/runs/{run_id}/stop", headers=AUTH, timeout=10).status_code == 202
    return asyncio.run(_trainer(trainer_url, lambda c: c.wait_run(run_id, timeout_s=1200, poll_s=0.5)))


def rows_of(run_dir: Path) -> list[dict[str, Any]]:
    by_id: dict[int, dict[str, Any]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert row["rollout_id"] not in by_id, f"rollout {row['rollout_id']} trained twice"
        by_id[row["rollout_id"]] = row
    return [by_id[k] for k in sorted(by_id)]


def check_record(run_dir: Path, leg_a_steps: int) -> None:
    rows = rows_of(run_dir)
    assert len(rows) >= NUM_ROLLOUT - 2  # drops are counted below; there should be (almost) none
    for r in rows:
        trainer_version = r["weight_version"] - 1  # a row's version is the one pushed after it
        staleness = trainer_version - r["batch/first_weight_version_min"]
        assert 0 <= staleness <= 1 and r["async/staleness"] == staleness, r
        assert r["batch/samples"] == 512.0 and 0.0 <= r["async/overlap"] <= 1.0
    assert [r["weight_version"] for r in rows] == sorted({r["weight_version"] for r in rows})
    rewards = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(rewards[:EDGE]) / EDGE, sum(rewards[-EDGE:]) / EDGE
    print(f"async CPU: reward first {EDGE} {first:.3f} -> last {EDGE} {last:.3f}; leg A {leg_a_steps} steps")
    assert last > first, rewards
    overlap = [r["async/overlap"] for r in rows[1:-1]]
    assert sum(overlap) / len(overlap) > 0.5  # the producer generated through most of each train phase


def check_redis(redis_url: str, run_id: str, run_dir: Path, rollout_url: str, prompts: int) -> None:
    r = redis.Redis.from_url(redis_url)
    try:
        entries = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(stream_key(run_id))]
        trained = {x.decode() for x in r.smembers(trained_key(run_id, 0))}
        dropped = {x.decode() for x in r.smembers(dropped_key(run_id))}
    finally:
        r.close()
    published = {e["batch_id"]: int(e["rollout_id"]) for e in entries}
    assert len(published) == len(entries) and sorted(published.values()) == list(range(NUM_ROLLOUT))
    assert trained | dropped == set(published) and not trained & dropped
    assert sorted(published[b] for b in trained) == [row["rollout_id"] for row in rows_of(run_dir)]
    state = httpx.get(rollout_url + "/v1/data-source/state", timeout=10).json()["state"]
    assert state["sample_group_index"] == NUM_ROLLOUT * prompts and state[PRODUCER_NEXT_KEY] == NUM_ROLLOUT
    print(f"async CPU: {len(published)} batches published, {len(trained)} trained, {len(dropped)} dropped")
