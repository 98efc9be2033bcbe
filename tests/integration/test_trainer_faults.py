"""The trainer dying is a fault the stack cannot absorb (the run's state dies with it): `vime train`
says what died and prints the exact command that resumes, and ``--resume`` continues the run after
its newest checkpoint with nothing trained twice in its records. Real processes: three legs of
one run id, each a `vime train` (Redis keeps its data in the run directory between them).

Leg 1 is SIGKILLed inside rollout 3 (the checkpoint is of rollout 1: ``save_interval`` 2), so
rollout 2 was trained and its weights lost. Leg 2 resumes at rollout 2 and is sent SIGTERM inside
rollout 3: the trainer stops within seconds and checkpoints rollout 2, its last finished step.
Leg 3 resumes at rollout 3 and finishes. metrics.jsonl then holds rollouts 0-5 once each (leg 1's
rollout 2 moved to metrics.superseded.jsonl), and the summary counts 6 steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_cli_support import TOKEN, leftovers, parent_pid, stack_config, start_vime, stop_vime, write_config

from vime import procs
from vime.launch.orphans import descendants

pytestmark = pytest.mark.slow

STARTUP_S = 280
LEG_S = 420
SIGTERM_ANSWER_S = 30
"""A trainer sent SIGTERM inside a rollout exits within this (the launcher would wait 60 s)."""
RESUME = re.compile(r"resume from the checkpoint of rollout (\d+):\s+(vime train .*--resume \S+)")


def _service_pid(child: procs.Child, module: str) -> int:
    found = [
        pid for pid, cmd in descendants(child.pid).items() if module in cmd and parent_pid(pid) == child.pid
    ]
    assert len(found) == 1, found
    return found[0]


def _trainer_pid(child: procs.Child) -> int:
    return _service_pid(child, "vime_trainer")


def _status(cfg: dict[str, Any]) -> dict[str, Any] | None:
    url = f"http://127.0.0.1:{cfg['services']['trainer_port']}/v1/runs/{cfg['run_id']}"
    try:
        r = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None
    return dict(r.json()) if r.status_code == 200 else None


def _inside_rollout(child: procs.Child, cfg: dict[str, Any], rollout_id: int) -> None:
    """Until the run is in the rollout phase of ``rollout_id``."""
    deadline = time.monotonic() + STARTUP_S + LEG_S
    while True:
        assert child.alive(), child.log_tail(60)
        assert time.monotonic() < deadline, f"never inside rollout {rollout_id}:\n{child.log_tail(60)}"
        s = _status(cfg)
        if s is not None and s["rollout_id"] == rollout_id and s["phase"] == "rollout":
            return
        time.sleep(0.02)


def _events(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    path = Path(cfg["output_dir"]) / cfg["run_id"] / "events.jsonl"
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in lines if x.endswith("}")]  # a line being written is skipped


def _engine_pid(cfg: dict[str, Any]) -> int:
    url = f"http://127.0.0.1:{cfg['services']['rollout_port']}/v1/engines"
    engines = httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()["engines"]
    assert len(engines) == 1, engines
    return int(engines[0]["pid"])


@contextlib.contextmanager
def _held_in_rollout(
    child: procs.Child, cfg: dict[str, Any], rollout_id: int, leg_start: str = "run.resume"
) -> Iterator[None]:
    """Inside rollout ``rollout_id`` of the leg that began with the event ``leg_start`` (``run.start``
    for a first leg), held there: the engine is stopped (SIGSTOP)
    as soon as the run's events show the step before it done, so the rollout cannot end before
    the block does (a rollout of the nano stack takes under a second, and its rewards need no
    reward service: a fault aimed at it by polling the run's phase landed in the training after
    it on a slow machine). The events file is read, not the REST status: it is written as things
    happen. The engine continues when the block ends."""
    deadline = time.monotonic() + STARTUP_S + LEG_S
    engine: int | None = None
    while True:
        assert child.alive(), child.log_tail(60)
        assert time.monotonic() < deadline, f"rollout {rollout_id - 1} never ended:\n{child.log_tail(60)}"
        events = _events(cfg)
        resumed = [k for k, e in enumerate(events) if e["action"] == leg_start]  # this leg's start
        if resumed and engine is None:
            engine = _engine_pid(cfg)  # the stack is up
        if resumed and any(
            e["action"] == "step.done" and e["rollout_id"] == rollout_id - 1 for e in events[resumed[-1] :]
        ):
            break
        time.sleep(0.005)
    assert engine is not None
    os.kill(engine, signal.SIGSTOP)
    try:
        _inside_rollout(child, cfg, rollout_id)
        time.sleep(0.5)  # its generates are under way, waiting for the engine
        s = _status(cfg)
        assert s is not None and (s["rollout_id"], s["phase"]) == (rollout_id, "rollout"), s
        assert not any(e["action"] == "rollout.done" and e["rollout_id"] == rollout_id for e in _events(cfg))
        yield
    finally:
        os.kill(engine, signal.SIGCONT)


def _resume_command(log: str) -> tuple[int, list[str]]:
    found = RESUME.findall(log)
    assert found, log[-3000:]
    checkpoint, command = found[-1]
    argv = shlex.split(command)
    assert argv[:2] == ["vime", "train"]
    return int(checkpoint), argv[2:]


def _leg(work: Path, n: int, args: list[str], mark: str, models: Path) -> procs.Child:
    return start_vime(work / f"leg{n}.log", *args, mark=mark, model_cache=models)


@pytest.mark.timeout(3 * (STARTUP_S + LEG_S))
def test_a_killed_trainer_gives_the_resume_command_and_the_resumed_run_trains_nothing_twice(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    models = tmp_path_factory.getbasetemp() / "models"
    cfg = stack_config(tmp_path, num_rollout=6, save_interval=2, rollout_max_response_len=16)
    config = write_config(tmp_path, cfg)
    mark = uuid.uuid4().hex
    run_dir = Path(cfg["output_dir"]) / cfg["run_id"]
    ckpt = Path(cfg["trainer"]["checkpoint_dir"]) / cfg["run_id"]

    leg1 = _leg(tmp_path, 1, ["train", "-c", str(config)], mark, models)
    try:
        with _held_in_rollout(leg1, cfg, 3, leg_start="run.start"):  # polled, a 0.2 s rollout was missed
            trainer = _trainer_pid(leg1)
            os.kill(trainer, signal.SIGKILL)
            while _alive(trainer):
                time.sleep(0.05)
        assert leg1.popen.wait(LEG_S) == 1
    finally:
        stop_vime(leg1, mark)
    log1 = leg1.log_path.read_text()  # type: ignore[union-attr]
    assert "trainer exited with code -9 (SIGKILL) during the run" in log1, log1[-3000:]
    assert "Traceback" not in log1.split("last lines of its log")[0]  # the launcher's own output
    checkpoint, args = _resume_command(log1)
    assert checkpoint == 1 and args == ["-c", str(config), "--resume", cfg["run_id"]]
    assert [json.loads(x)["rollout_id"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [
        0,
        1,
        2,
    ]

    leg2 = _leg(tmp_path, 2, ["train", *args], mark, models)
    try:
        with _held_in_rollout(leg2, cfg, 3):  # until the trainer is gone: the rollout cannot end first
            trainer = _trainer_pid(leg2)
            os.kill(trainer, signal.SIGTERM)  # the process alone, as a service manager would
            t0 = time.monotonic()
            while procs.port_open("127.0.0.1", cfg["services"]["trainer_port"]) or _alive(trainer):
                assert time.monotonic() - t0 < SIGTERM_ANSWER_S, leg2.log_tail(60)
                time.sleep(0.2)
        print(f"\nFAULT trainer_sigterm: the trainer exited {time.monotonic() - t0:.1f} s after SIGTERM")
        assert leg2.popen.wait(LEG_S) == 1
    finally:
        stop_vime(leg2, mark)
    log2 = leg2.log_path.read_text()  # type: ignore[union-attr]
    assert "trainer exited with code" in log2 and "during the run" in log2, log2[-3000:]
    checkpoint, again = _resume_command(log2)
    assert checkpoint == 2 and again == args, log2[-3000:]  # the last finished step, written on the way out
    state = json.loads((ckpt / "rollout_0000002" / "vime_state.json").read_text())
    assert state["next_rollout_id"] == 3

    leg3 = _leg(tmp_path, 3, ["train", *again], mark, models)
    t0 = time.monotonic()
    try:
        assert leg3.popen.wait(STARTUP_S + LEG_S) == 0, leg3.log_tail(80)
    finally:
        stop_vime(leg3, mark)
    print(
        f"FAULT trainer_killed: the resumed leg ran 3 rollouts in {time.monotonic() - t0:.1f} s, start-up included"
    )
    log3 = leg3.log_path.read_text()  # type: ignore[union-attr]
    assert f"run {cfg['run_id']}: finished, 6 steps" in log3 and "--resume" not in log3
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["weight_version"] for r in rows] == [2, 3, 4, 5, 6, 7]  # versions continue across legs
    superseded = [json.loads(x) for x in (run_dir / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in superseded] == [2]  # leg 1's rollout 2: trained, weights lost
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    done = [e["rollout_id"] for e in events if e["action"] == "step.done"]
    assert done == [0, 1, 2, 3, 4, 5]
    assert [e["detail"]["next_rollout_id"] for e in events if e["action"] == "run.resume"] == [2, 3]
    assert (run_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert leftovers(mark) == {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"
