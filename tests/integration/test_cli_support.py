"""Helpers of the CLI tests (no tests in this module): `vime` as a real process, a tiny stack
config on free ports, the command started with a marker in its environment (inherited by every
process it starts, so a leftover is found whatever started it), and waits on its output."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from vime import procs
from vime.launch.orphans import command_line, descendants

MARK = "VIME_TEST_CLI_MARK"
TOKEN = "it-cli-token"


def stack_config(work: Path, **extra: Any) -> dict[str, Any]:
    """The smallest full stack: nano model, one reference engine, 2 prompts × 4 samples."""
    ports = {
        f"{n}_port": procs.free_port() for n in ("router", "router_control", "reward", "rollout", "trainer")
    }
    cfg: dict[str, Any] = {
        "run_id": f"it-{uuid.uuid4().hex[:6]}",
        "output_dir": str(work / "runs"),
        "num_rollout": 2,
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 4,
        "micro_batch_size": 4,
        "rollout_max_prompt_len": 16,
        "rollout_max_response_len": 4,
        "rollout_max_context_len": 32,
        "rollout_num_gpus": 0,
        "rollout_num_engines_cpu": 1,
        "vllm_server_concurrency": 16,
        "actor_num_gpus_per_node": 0,
        "actor_num_cpu_ranks": 1,
        "tensor_model_parallel_size": 1,
        "colocate": False,
        "model": {"tiny_model_size": "nano"},
        "reward": {"rm_type": "arithmetic", "num_workers": 1},
        "engine": {"backend": "reference", "base_port": procs.free_port_run(), "startup_timeout_s": 240},
        "trainer": {"checkpoint_dir": str(work / "checkpoints")},
        "services": {"host": "127.0.0.1", "api_token": TOKEN, **ports},
    }
    for key, value in extra.items():
        section, _, field = key.partition("__")
        if field:
            cfg.setdefault(section, {})[field] = value
        else:
            cfg[key] = value
    return cfg


def write_config(work: Path, cfg: dict[str, Any]) -> Path:
    path = work / f"{cfg['run_id']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def resolved_config(cfg: dict[str, Any]) -> Path:
    """Where `vime up` writes the config it resolved (run id, Redis URL)."""
    return Path(cfg["output_dir"]) / cfg["run_id"] / "config.yaml"


def stack_ports(cfg: dict[str, Any]) -> list[int]:
    """Every port the stack listens on (services, engine, private Redis)."""
    ports = [v for k, v in cfg["services"].items() if k.endswith("_port")]
    ports.append(cfg["engine"]["base_port"])
    resolved = yaml.safe_load(resolved_config(cfg).read_text())
    ports.append(int(resolved["services"]["redis_url"].rsplit(":", 1)[1].split("/")[0]))
    return ports


def env(mark: str, model_cache: Path) -> dict[str, str]:
    return {MARK: mark, "VIME_MODEL_CACHE": str(model_cache), "COLUMNS": "200"}


def start_vime(log: Path, *args: str, mark: str, model_cache: Path) -> procs.Child:
    """``python -m vime ARGS`` in its own process group, output in ``log``."""
    return procs.start(
        "vime", [sys.executable, "-m", "vime", *args], log_path=log, env=env(mark, model_cache)
    )


def run_vime(*args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """A client command with no token in its environment: it finds the one its stack generated
    beside the resolved config (resolved configs never hold a token)."""
    environ = {k: v for k, v in os.environ.items() if k != "VIME_API_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "vime", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**environ, "COLUMNS": "200"},
    )


def wait_for_output(child: procs.Child, text: str, timeout_s: float) -> None:
    """Until ``text`` is in the child's log; fails with the log if it exits or time runs out."""
    assert child.log_path is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in child.log_path.read_text(errors="replace"):
            return
        if not child.alive():
            raise AssertionError(f"vime exited with {child.popen.returncode}:\n{child.log_tail(60)}")
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} after {timeout_s:.0f}s:\n{child.log_tail(60)}")


def wait_exit(child: procs.Child, timeout_s: float) -> int:
    try:
        return child.popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"vime still running after {timeout_s:.0f}s:\n{child.log_tail(60)}") from None


def leftovers(mark: str) -> dict[int, str]:
    """Live processes whose environment carries the test's marker (a process that rewrites its
    environment, like redis-server, hides from this: `survivors` covers those)."""
    needle = f"{MARK}={mark}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found[int(entry.name)] = command_line(int(entry.name))
    return {pid: cmd for pid, cmd in found.items() if _state(pid) not in (None, "Z")}


def survivors(tree: dict[int, str]) -> dict[int, str]:
    """Processes of an earlier snapshot (pid -> command line) that still run."""
    return {
        pid: cmd for pid, cmd in tree.items() if _state(pid) not in (None, "Z") and command_line(pid) == cmd
    }


def _state(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()[0]


def stop_vime(child: procs.Child, mark: str) -> None:
    """Test clean-up: let `vime` tear its stack down (SIGTERM); kill whatever is left after that.

    Killing `vime` first would orphan its children, and some of them (redis-server) keep no
    marker in their environment, so the tree is snapshotted while it is still whole."""
    tree = descendants(child.pid) if child.alive() else {}
    if child.alive():
        os.kill(child.pid, signal.SIGTERM)
        try:
            child.popen.wait(120)
        except subprocess.TimeoutExpired:
            child.kill()
    for pid in {**survivors(tree), **leftovers(mark)}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def parent_pid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")
