"""`vime up`, `vime status`, `vime rollout` and `vime train` as real processes over a real stack:
Redis, router (vllm-router), reward, rollout manager with a CPU reference engine, trainer.

What must hold: `up` starts everything and `status` sees it healthy; with no token configured it
generates one (printed once, kept 0600 in the run directory) and nothing answers without it;
`rollout` returns the
rollout's samples and publishes nothing a later run could train on; Ctrl-C stops every process the stack started (engines, vllm-router and Ray
workers are grandchildren) and frees every port; a child that dies and is not restarted (the
rollout manager) takes the stack down with a non-zero exit and the child's log tail; a busy port is refused before anything starts; `train`
runs to the end and leaves metrics.jsonl and report.png.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from test_cli_support import (
    leftovers,
    parent_pid,
    resolved_config,
    run_vime,
    stack_config,
    stack_ports,
    start_vime,
    stop_vime,
    survivors,
    wait_exit,
    wait_for_output,
    write_config,
)

from vime import procs
from vime.launch.orphans import descendants
from vime.queue import stream_key

pytestmark = pytest.mark.slow

STARTUP_S = 280


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@dataclass
class Launched:
    cfg: dict[str, Any]
    child: procs.Child
    mark: str

    @property
    def resolved(self) -> Path:
        return resolved_config(self.cfg)


def _launch(command: str, work: Path, model_cache: Path, **extra: Any) -> Launched:
    """``vime <command> -c <config>`` on a fresh stack config (``extra`` changes it), marked."""
    cfg = stack_config(work, **extra)
    mark = uuid.uuid4().hex
    child = start_vime(
        work / f"{command}.log",
        command,
        "-c",
        str(write_config(work, cfg)),
        mark=mark,
        model_cache=model_cache,
    )
    return Launched(cfg, child, mark)


def _stop(launched: Launched) -> None:
    stop_vime(launched.child, launched.mark)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Launched]:
    """`vime up` with no token configured: the stack makes its own."""
    up = _launch("up", tmp_path_factory.mktemp("cli-up"), model_cache, services__api_token=None)
    try:
        wait_for_output(up.child, "is up", STARTUP_S)
        yield up
    finally:
        _stop(up)


def _status(*args: str, cwd: Path | None = None) -> tuple[int, dict[str, Any]]:
    proc = run_vime("status", "--json", *args, cwd=cwd)
    return proc.returncode, json.loads(proc.stdout)


def test_status_sees_every_service_healthy(stack: Launched) -> None:
    code, st = _status("-c", str(stack.resolved))
    assert code == 0 and st["healthy"], st
    assert {s["name"]: s["healthy"] for s in st["services"]} == dict.fromkeys(
        ("router_control", "router", "reward", "rollout", "trainer"), True
    )
    assert st["redis"] == "ok"
    assert [(e["backend"], e["status"]) for e in st["engines"]] == [("reference", "ready")]
    assert st["run"] is None  # nothing trained yet
    # Without --config: the newest stack under output_dir (runs/latest) is found.
    code, again = _status("--set", f"output_dir={stack.cfg['output_dir']}")
    assert code == 0 and again["redis"] == "ok"
    assert os.readlink(Path(stack.cfg["output_dir"]) / "latest") == stack.cfg["run_id"]


def test_the_stack_generated_its_token_and_nothing_answers_without_it(stack: Launched) -> None:
    run_dir = stack.resolved.parent
    token_file = run_dir / "api_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32 and token not in stack.resolved.read_text()
    assert stack.child.log_path is not None
    assert stack.child.log_path.read_text(errors="replace").count(token) == 1  # printed once
    services = yaml.safe_load(stack.resolved.read_text())["services"]
    trainer = f"http://127.0.0.1:{services['trainer_port']}"
    rollout = f"http://127.0.0.1:{services['rollout_port']}"
    router = f"http://127.0.0.1:{services['router_control_port']}"
    for url, path in ((trainer, "/v1/runs"), (rollout, "/v1/admission/pause"), (router, "/v1/engines")):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(url + path, json={}, headers=headers, timeout=30)
            assert r.status_code == 401, (path, r.text)
    assert httpx.get(router + "/v1/data-plane", timeout=30).status_code == 401
    auth = {"Authorization": f"Bearer {token}"}
    assert httpx.get(router + "/v1/data-plane", headers=auth, timeout=30).json()["ready"]


def test_a_healthy_start_prints_only_the_launchers_lines(stack: Launched) -> None:
    """Services log their normal lifecycle (engines admitted, data-plane workers, the route filter)
    at info; the console shows warnings and errors only, so a healthy start shows none of theirs."""
    assert stack.child.log_path is not None
    text = stack.child.log_path.read_text(errors="replace")
    start = text[: text.index("Ctrl-C stops everything")]
    assert "is up" in start and "✓ trainer" in start
    service_lines = [line for line in start.splitlines() if " │ " in line]
    assert not service_lines, "\n".join(service_lines)


def test_rollout_returns_scored_samples(stack: Launched, tmp_path: Path) -> None:
    """The samples come back; nothing reaches the stack's Redis stream, the prompts are given back."""
    resolved = yaml.safe_load(stack.resolved.read_text())
    rollout_url = f"http://127.0.0.1:{resolved['services']['rollout_port']}"
    state = httpx.get(rollout_url + "/v1/data-source/state", timeout=30).json()
    out = tmp_path / "samples.jsonl"
    proc = run_vime(
        "rollout", "-c", str(stack.resolved), "--rollout-id", "7", "--out", str(out), "--show", "3"
    )
    assert proc.returncode == 0, proc.stderr
    r = redis.Redis.from_url(resolved["services"]["redis_url"])
    try:
        assert r.exists(stream_key(resolved["run_id"])) == 0  # a run started later finds no batch
    finally:
        r.close()
    assert httpx.get(rollout_url + "/v1/data-source/state", timeout=30).json() == state
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    n, prompts = stack.cfg["n_samples_per_prompt"], stack.cfg["rollout_batch_size"]
    assert len(samples) == n * prompts
    groups: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault(s["group_index"], []).append(s)
        assert re.fullmatch(r"\d+\+\d+=", s["prompt"]), s
        assert s["reward"] in (0.0, 1.0) and s["status"] in ("completed", "truncated")
        assert 0 < len(s["response_ids"]) <= stack.cfg["rollout_max_response_len"]
    assert sorted(len(g) for g in groups.values()) == [n] * prompts
    assert all(len({s["prompt"] for s in g}) == 1 for g in groups.values())  # a group shares its prompt
    assert all(isinstance(s["advantage"], float) for s in samples)
    assert (
        f"rollout 7: {n * prompts} samples (not published)" in proc.stderr and "reward_mean=" in proc.stderr
    )
    assert proc.stdout.count(" → ") == 3


def test_rollout_against_no_stack_fails_clearly(tmp_path: Path) -> None:
    cfg = stack_config(tmp_path)  # ports nobody listens on
    proc = run_vime("rollout", "-c", str(write_config(tmp_path, cfg)), timeout=60)
    assert proc.returncode == 1 and "rollout failed" in proc.stderr


def test_ctrl_c_stops_every_process_and_frees_every_port(stack: Launched) -> None:
    tree = descendants(stack.child.pid)  # the whole stack: `up` is a subreaper, nothing escaped yet
    commands = " ".join(tree.values())
    for part in (
        "redis-server",
        "vime_router",
        "vllm::router",  # vllm-router names itself so (setproctitle)
        "caddy run",  # the route filter
        "vime_reward",
        "vime_rollout",
        "vime_trainer",
    ):
        assert part in commands, f"{part} not among the stack's processes: {tree}"
    assert "vime_rollout.reference_engine" in commands
    ports = stack_ports(stack.cfg)
    assert all(procs.port_open("127.0.0.1", p) for p in ports)
    os.kill(stack.child.pid, signal.SIGINT)
    assert wait_exit(stack.child, 150) == 128 + signal.SIGINT
    assert survivors(tree) == {} and leftovers(stack.mark) == {}
    assert [p for p in ports if procs.port_open("127.0.0.1", p)] == []
    log = stack.child.log_tail(60)
    for name in ("trainer", "rollout", "reward", "router", "redis"):  # each one stopped on SIGTERM
        assert re.search(rf"■ {name}\s+stopped in", log), log
    code, st = _status("-c", str(stack.resolved))
    assert code == 1 and not any(s["healthy"] for s in st["services"])


def test_a_dying_child_takes_the_stack_down_with_its_log_tail(tmp_path: Path, model_cache: Path) -> None:
    up = _launch("up", tmp_path, model_cache)
    try:
        wait_for_output(up.child, "is up", STARTUP_S)
        tree = descendants(up.child.pid)
        rollout = [
            pid for pid, cmd in tree.items() if "vime_rollout" in cmd and parent_pid(pid) == up.child.pid
        ]
        assert len(rollout) == 1
        os.kill(rollout[0], signal.SIGKILL)  # its engines are orphaned: the launcher sweeps them
        assert wait_exit(up.child, 150) == 1
        log = up.child.log_path.read_text()  # type: ignore[union-attr]
        assert "rollout exited with code -9 (SIGKILL)" in log and "last lines of its log" in log
        assert survivors(tree) == {} and leftovers(up.mark) == {}
        assert [p for p in stack_ports(up.cfg) if procs.port_open("127.0.0.1", p)] == []
    finally:
        _stop(up)


def test_a_child_failing_at_start_fails_up_with_the_reason(tmp_path: Path, model_cache: Path) -> None:
    up = _launch("up", tmp_path, model_cache, model__hf_checkpoint=str(tmp_path / "no-such-model"))
    try:
        assert wait_exit(up.child, 150) == 1
        log = up.child.log_path.read_text()  # type: ignore[union-attr]
        assert "rollout exited with code" in log and "no-such-model" in log and "does not exist" in log, log
        assert "trainer" not in re.findall(r"✓ (\w+)", log)  # never started: the rollout came first
        assert leftovers(up.mark) == {}
    finally:
        _stop(up)


def test_a_busy_port_is_refused_before_anything_starts(tmp_path: Path, model_cache: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        up = _launch("up", tmp_path, model_cache, services__rollout_port=taken)
        try:
            assert wait_exit(up.child, 60) == 1
            log = up.child.log_path.read_text()  # type: ignore[union-attr]
            assert f"port {taken} (rollout) is already in use" in log
            assert "✓" not in log and leftovers(up.mark) == {}
        finally:
            _stop(up)


@pytest.mark.timeout(600)
def test_train_runs_to_the_end_and_leaves_its_records(tmp_path: Path, model_cache: Path) -> None:
    train = _launch("train", tmp_path, model_cache, num_rollout=2)
    cfg, child = train.cfg, train.child
    try:
        assert wait_exit(child, 540) == 0, child.log_tail(80)
        log = child.log_path.read_text()  # type: ignore[union-attr]
        run_dir = Path(cfg["output_dir"]) / cfg["run_id"]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["rollout_id"] for r in rows] == [0, 1]
        assert rows[1]["weight_version"] == rows[0]["weight_version"] + 1
        for r in rows:
            assert r["perf/T_step"] > 0 and 0.0 <= r["rollout/reward_mean"] <= 1.0
        png = (run_dir / "report.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
        for text in (
            "step   0",
            "step   1",
            "T_step",
            f"run {cfg['run_id']}: finished, 2 steps",
            "reward mean",
        ):
            assert text in log, text
        assert leftovers(train.mark) == {}
    finally:
        _stop(train)


def test_ctrl_c_during_train_stops_the_run_after_its_step(tmp_path: Path, model_cache: Path) -> None:
    train = _launch("train", tmp_path, model_cache, num_rollout=500)
    cfg, child = train.cfg, train.child
    try:
        wait_for_output(child, "step   1 ", STARTUP_S)
        tree = descendants(child.pid)
        os.kill(child.pid, signal.SIGINT)
        assert wait_exit(child, 150) == 0  # a stop the user asked for, completed
        log = child.log_path.read_text()  # type: ignore[union-attr]
        assert "stopping after the current step" in log and f"run {cfg['run_id']}: stopped" in log
        rows = (Path(cfg["output_dir"]) / cfg["run_id"] / "metrics.jsonl").read_text().splitlines()
        assert 2 <= len(rows) < 500
        assert survivors(tree) == {} and leftovers(train.mark) == {}
    finally:
        _stop(train)
