"""The launcher's restart policy: Redis, the router and the reward service are started again when
they exit (their state survives them), at most `MAX_RESTARTS` times in `RESTART_WINDOW_S`; the
rollout manager and the trainer are not (their exit fails the stack). Real child processes."""

from __future__ import annotations

import io
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from vime import procs
from vime.config import load_config
from vime.launch.signals import SignalLatch
from vime.launch.stack import ServiceSpec, StackPlan
from vime.launch.supervisor import MAX_RESTARTS, RESTARTED, Supervisor
from vime.retry import poll_until_blocking

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[Supervisor]:
    nobody = f"http://127.0.0.1:{procs.free_port()}"  # never healthy: a restart stays pending
    specs = [ServiceSpec(name, SLEEPER, nobody) for name in ("reward", "trainer")]
    cfg = load_config(overrides=[f"output_dir={tmp_path}"], environ={})
    plan = StackPlan(cfg, "r", tmp_path, tmp_path / "config.yaml", tmp_path / "logs", None, specs)
    s = Supervisor(plan, Console(file=io.StringIO(), width=200), SignalLatch())
    for spec in specs:
        s.children.append(s._spawn(spec, {}))
    try:
        yield s
    finally:
        for child in s.children:
            child.kill()


def _kill(child: procs.Child) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.popen.wait(10)


def _output(sup: Supervisor) -> str:
    return sup.console.file.getvalue()  # type: ignore[attr-defined]


def test_a_stateless_service_is_restarted_and_a_stateful_one_fails_the_stack(sup: Supervisor) -> None:
    assert {"redis", "router", "reward"} == set(RESTARTED)
    reward, trainer = sup.children
    _kill(reward)
    assert sup.check() is None
    again = sup.children[0]
    assert again.name == "reward" and again.pid != reward.pid and again.alive()
    assert "↻ reward exited with code -9; restarting it (1/3" in _output(sup)
    _kill(trainer)
    assert sup.check() is trainer  # the run's state died with it: not restarted
    assert "trainer exited with code -9 (SIGKILL)" in sup.death_message(trainer)


def test_a_service_that_keeps_dying_is_given_up(sup: Supervisor) -> None:
    for n in range(MAX_RESTARTS):
        previous = sup.children[0]
        _kill(previous)
        poll_until_blocking(
            lambda p=previous: sup.check() is None and sup.children[0] is not p,  # type: ignore[misc]
            timeout_s=10,
            interval_s=0.05,
            what=f"restart {n + 1}",
        )
    last = sup.children[0]
    _kill(last)
    assert sup.check() is last
