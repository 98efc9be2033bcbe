"""Finding every process a launch started, grandchildren included, by an environment marker.

Services start their own children in separate process groups (engines, vllm-router, Ray's
workers), so stopping a service's group does not reach them if the service dies first. The
launcher puts ``VIME_LAUNCH_ID=<random id>`` into its own environment before starting anything;
every descendant inherits it, and after the teardown any process still carrying it is killed.
Linux only (``/proc``); elsewhere the sweep finds nothing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
from pathlib import Path

MARKER = "VIME_LAUNCH_ID"


def mark_this_process() -> str:
    """Set a fresh launch id in this process's environment (inherited by all children)."""
    launch_id = secrets.token_hex(8)
    os.environ[MARKER] = launch_id
    return launch_id


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours
        return False
    return needle in data.split(b"\0")


def _command(pid: int) -> str:
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    return "?"


def marked_processes(launch_id: str, key: str = MARKER) -> dict[int, str]:
    """Live processes (not this one) whose environment holds ``key=launch_id``: pid -> command line."""
    proc = Path("/proc")
    if not proc.is_dir():
        return {}
    needle = f"{key}={launch_id}".encode()
    me = os.getpid()
    found = {}
    for entry in proc.iterdir():
        if entry.name.isdigit() and int(entry.name) != me and _environ_has(int(entry.name), needle):
            found[int(entry.name)] = _command(int(entry.name))
    return found


def kill_marked(launch_id: str) -> dict[int, str]:
    """SIGKILL every process left with this launch id; returns what was killed."""
    leftovers = marked_processes(launch_id)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return leftovers
