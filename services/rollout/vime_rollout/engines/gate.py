"""The gate in front of each engine the rollout manager starts: its port is Caddy's, the engine
listens only on a Unix socket in a directory of this user's alone (mode 0700).

vLLM's control routes (``/sleep``, ``/pause``, ``/update_weights`` — which unpickles what it is
sent —, ``/collective_rpc`` …) have no authentication, and a port on 127.0.0.1 is open to every
local user. Behind the gate, a request without the stack's bearer token reaches the engine only
when it is a read (``GET``/``HEAD``) or one of the data plane's generate routes
(`vime.wire.router.PUBLIC_ROUTES`, what vllm-router forwards); every other request is answered 401
by Caddy. The rollout manager and the trainer send the token on every engine call
(`ServicesConfig.token`). With no token (``services.insecure``) the gate passes everything, like
the services themselves. The token is in the gate's configuration file, in the same private
directory as the socket; Caddy's admin API is off, so nothing can change the gate while it runs.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from vime.caddy import caddy_binary, refusal, upstream_failed
from vime.wire.router import PUBLIC_ROUTES
from vime_rollout.engines.spec import EngineSpec

OPEN_METHODS = ("GET", "HEAD")


def private_dir() -> Path:
    """A new directory only this user can enter, with a short path (a socket path has ≤ 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="vime-eng-", dir="/tmp" if os.path.isdir("/tmp") else None))


CONTAINER_DIR = "/tmp/vime-gate"
"""Where an engine in a container (`engines.gated`) puts its socket: the container's own /tmp."""


def behind_gates(specs: list[EngineSpec], directory: str | Path | None = None) -> list[EngineSpec]:
    """The same engines, each listening on a socket in ``directory`` (None: one new private one)."""
    where = Path(directory) if directory is not None else private_dir()
    return [replace(s, socket=str(where / f"{s.name}.sock")) for s in specs]


def _routes(socket_path: str, token: str | None) -> list[dict[str, Any]]:
    proxy = {
        "handler": "reverse_proxy",
        "upstreams": [{"dial": f"unix/{socket_path}"}],
        # one idle connection per concurrent generate (Caddy keeps 32 by default); streams pass as they come
        "transport": {"protocol": "http", "keep_alive": {"max_idle_conns_per_host": 4096}},
        "flush_interval": -1,
    }
    if token is None:
        return [{"handle": [proxy]}]
    data_plane = [p for p, methods in PUBLIC_ROUTES.items() if "POST" in methods]
    return [
        {"match": [{"header": {"Authorization": [f"Bearer {token}"]}}], "handle": [proxy], "terminal": True},
        {"match": [{"method": list(OPEN_METHODS)}], "handle": [proxy], "terminal": True},
        {"match": [{"method": ["POST"], "path": data_plane}], "handle": [proxy], "terminal": True},
        {
            "handle": [
                refusal(
                    401, "this engine route needs the stack's bearer token (only reads and generate are open)"
                )
            ]
        },
    ]


def gate_config(*, host: str, port: int, socket_path: str, token: str | None) -> dict[str, Any]:
    """Caddy's JSON configuration of one engine's gate."""
    return {
        "admin": {"disabled": True, "config": {"persist": False}},
        "logging": {"logs": {"default": {"level": "WARN"}}},
        "apps": {
            "http": {
                "grace_period": "5s",
                "servers": {
                    "engine": {
                        "listen": [f"{host}:{port}"],
                        "automatic_https": {"disable": True},
                        "read_header_timeout": "10s",
                        "idle_timeout": "75s",
                        "routes": _routes(socket_path, token),
                        "errors": {
                            "routes": [upstream_failed("the engine did not answer: {http.error.status_text}")]
                        },
                    }
                },
            }
        },
    }


def prepare_gate(
    name: str, *, host: str, port: int, socket_path: str, token: str | None
) -> tuple[list[str], list[Path]]:
    """Caddy's command for ``name``'s gate (its configuration written beside the socket, an earlier
    life's socket removed: the engine's bind would fail), and the files to remove once gate and
    engine have stopped: the socket, and the configuration, which holds the token."""
    socket = Path(socket_path)
    socket.unlink(missing_ok=True)
    argv = gate_argv(socket.parent, name, host=host, port=port, socket_path=socket_path, token=token)
    return argv, [socket, Path(argv[-1])]


def gate_argv(
    directory: Path, name: str, *, host: str, port: int, socket_path: str, token: str | None
) -> list[str]:
    """Write ``name``'s configuration (mode 0600) into ``directory`` and return Caddy's command."""
    path = directory / f"{name}-gate.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(gate_config(host=host, port=port, socket_path=socket_path, token=token), f)
    return [caddy_binary(), "run", "--config", str(path)]
