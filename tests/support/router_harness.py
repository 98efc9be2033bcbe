"""Start fake engines and the router service as real processes on loopback, for tests and benches."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vime import procs

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")


@dataclass
class FakeEngineProcess:
    """A running `fake_engine.py`; behind a gate (``gate``), ``port`` is the gate's, the engine
    listens on ``socket`` and the fake's own control routes need ``token``."""

    engine_id: str
    port: int
    child: procs.Child
    gate: procs.Child | None = None
    socket: str | None = None
    token: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def stats(self) -> dict[str, Any]:
        """The engine's counters (generate_total, in_flight, control_calls, sessions, ...)."""
        return dict(httpx.get(f"{self.url}/fake/stats", headers=self.headers(), timeout=5).json())

    def configure(self, **changes: Any) -> dict[str, Any]:
        """Change ``delay_s`` or ``healthy`` while it runs."""
        r = httpx.post(f"{self.url}/fake/config", json=changes, headers=self.headers(), timeout=5)
        return dict(r.raise_for_status().json())

    def children(self) -> list[procs.Child]:
        return [self.child, *([self.gate] if self.gate else [])]


def start_fake_engine(
    engine_id: str,
    log_dir: Path,
    *,
    delay_s: float = 0.0,
    port: int | None = None,
    max_tokens_cap: int = 64,
    gate_dir: Path | None = None,
    token: str | None = None,
) -> FakeEngineProcess:
    """Start one fake engine (not waiting for it); with ``gate_dir``, behind its gate as the rollout
    manager starts an engine (`vime_rollout.engines.gate`): the engine on a Unix socket in that
    private directory, Caddy on ``port`` (``token`` its key)."""
    port = port or procs.free_port()
    gate, socket = None, None
    if gate_dir is not None:
        from vime_rollout.engines.gate import gate_argv

        socket = str(gate_dir / f"{engine_id}.sock")
        argv = gate_argv(gate_dir, engine_id, host="127.0.0.1", port=port, socket_path=socket, token=token)
        gate = procs.start(f"gate-{engine_id}", argv, log_path=log_dir / f"gate-{engine_id}.log")
    argv = [
        sys.executable,
        str(FAKE_ENGINE),
        *(["--uds", socket] if socket else ["--port", str(port)]),
        "--engine-id",
        engine_id,
        "--delay-s",
        str(delay_s),
        "--max-tokens-cap",
        str(max_tokens_cap),
    ]
    child = procs.start(f"fake-{engine_id}", argv, log_path=log_dir / f"fake-{engine_id}.log")
    return FakeEngineProcess(engine_id, port, child, gate, socket, token if gate else None)


def start_fake_engines(
    count: int,
    log_dir: Path,
    *,
    delay_s: float = 0.0,
    prefix: str = "e",
    max_tokens_cap: int = 64,
    gate_dir: Path | None = None,
    token: str | None = None,
) -> list[FakeEngineProcess]:
    """Start ``count`` fake engines ``e0..e{count-1}`` (behind gates: `start_fake_engine`) and wait
    until each answers /health."""
    engines = [
        start_fake_engine(
            f"{prefix}{i}",
            log_dir,
            delay_s=delay_s,
            max_tokens_cap=max_tokens_cap,
            gate_dir=gate_dir,
            token=token,
        )
        for i in range(count)
    ]
    try:
        for e in engines:
            procs.wait_healthy(e.url, e.child, timeout_s=60)
    except Exception:
        stop_all(c for e in engines for c in e.children())
        raise
    return engines


@dataclass
class RouterProcess:
    """A running ``python -m vime_router``."""

    child: procs.Child
    control_url: str
    data_url: str
    token: str | None
    log_dir: Path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def register(self, engine: FakeEngineProcess, **extra: Any) -> dict[str, Any]:
        body = {"url": engine.url, "id": engine.engine_id, **extra}
        r = httpx.post(f"{self.control_url}/v1/engines", json=body, headers=self.headers(), timeout=30)
        r.raise_for_status()
        return dict(r.json())

    def engines(self) -> dict[str, dict[str, Any]]:
        """GET /v1/engines, by engine id."""
        r = httpx.get(f"{self.control_url}/v1/engines", headers=self.headers(), timeout=10)
        r.raise_for_status()
        return {e["id"]: e for e in r.json()["engines"]}

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("headers", self.headers())
        return httpx.post(f"{self.control_url}{path}", timeout=30, **kwargs)


def start_router(
    log_dir: Path, *, token: str | None = None, overrides: Sequence[str] = (), timeout_s: float = 60.0
) -> RouterProcess:
    """Start the router service on free ports and wait until both planes are up; with no ``token``
    it is started ``--insecure`` (every route open), as it refuses to start otherwise."""
    control, data = procs.free_port(), procs.free_port()
    argv = procs.python_module(
        "vime_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(control),
        "--data-port",
        str(data),
        "--log-dir",
        str(log_dir / "router-children"),
        *[arg for o in overrides for arg in ("--set", o)],
        *([] if token else ["--insecure"]),
    )
    env = {"VIME_API_TOKEN": token} if token else None
    child = procs.start("router", argv, log_path=log_dir / "router.log", env=env)
    url = f"http://127.0.0.1:{control}"
    procs.wait_healthy(url, child, timeout_s=timeout_s)
    return RouterProcess(child, url, f"http://127.0.0.1:{data}", token, log_dir)


def stop_all(children: Iterable[procs.Child]) -> None:
    for child in children:
        child.stop(grace_s=10)
