"""Finding and ending every process a launch started, grandchildren included.

Services start their own children in separate process groups and sessions (engines,
vllm-router, Ray's workers), so stopping a service's process group does not reach them if the
service dies first, and some of them rewrite their command line and environment (redis-server,
setproctitle), so no marker survives in them. Instead the launcher becomes a *child subreaper*
(Linux ``PR_SET_CHILD_SUBREAPER``): an orphaned descendant is re-parented to the launcher, not to
init, so after the services are stopped whatever is left of the tree is still the launcher's
descendant, found by walking parent links in ``/proc``, killed and reaped. Elsewhere (no
``/proc``, no prctl) only the services' own process groups are stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from pathlib import Path

from vime.retry import poll_until_blocking

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ..." — comm may hold spaces and parentheses.
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0]


def command_line(pid: int) -> str:
    """The process's command line (as it shows it now), shortened."""
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    return "?"


def descendants(root: int) -> dict[int, str]:
    """Live (not zombie) descendants of ``root``: pid -> command line."""
    proc = Path("/proc")
    if not proc.is_dir():
        return {}
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[0], []).append(int(entry.name))
            states[int(entry.name)] = st[1]
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        if states.get(pid) != "Z":
            found[pid] = command_line(pid)
    return found


def reap() -> None:
    """Collect exited children (re-parented orphans included) so none stays a zombie."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def kill_descendants(timeout_s: float = 5.0) -> dict[int, str]:
    """SIGKILL every process still below this one, reap them; returns what was killed."""
    killed = descendants(os.getpid())

    def none_left() -> bool:
        left = descendants(os.getpid())
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        reap()
        return not left

    with contextlib.suppress(TimeoutError):
        poll_until_blocking(none_left, timeout_s=timeout_s, interval_s=0.05, what="descendants gone")
    reap()
    return killed
