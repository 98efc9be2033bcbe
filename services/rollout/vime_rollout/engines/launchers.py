"""How engine processes come to exist: local children, sibling containers, or nothing (external).

All three sit behind one small interface so that the engine group, its health monitor and its
restarts do not care where an engine runs. Only launchers that own the process can restart it;
for an external engine the group waits until it answers again.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Protocol

from vime import procs
from vime_rollout.engines.commands import EngineCommand
from vime_rollout.engines.gate import prepare_gate
from vime_rollout.engines.gated import TOKEN_ENV
from vime_rollout.engines.spec import EngineSpec

log = logging.getLogger("vime.rollout.engines")


class EngineProcess(Protocol):
    """A started engine: whether it still runs (None: cannot tell), and how to stop it."""

    def alive(self) -> bool | None: ...

    def stop(self) -> None: ...

    def log_tail(self) -> str: ...


class Launcher(Protocol):
    can_restart: bool

    def start(self, spec: EngineSpec, command: EngineCommand | None) -> EngineProcess: ...


class LocalProcess:
    """An engine that is a child process of the rollout manager (own process group), with its gate
    when it has one (the engine is down when either is)."""

    def __init__(
        self, child: procs.Child, gate: procs.Child | None = None, private: list[Path] | None = None
    ) -> None:
        self.child = child
        self.gate = gate
        self.private = private or []
        """The gate's files (its config holds the token, and the socket), removed once both stopped."""
        self.pid = child.pid

    def alive(self) -> bool | None:
        return self.child.alive() and (self.gate is None or self.gate.alive())

    def stop(self) -> None:
        self.child.stop(grace_s=15.0)
        if self.gate is not None:
            self.gate.stop(grace_s=5.0)
        for path in self.private:  # the directory stays: a restart starts the engine in it again
            path.unlink(missing_ok=True)

    def log_tail(self) -> str:
        return self.child.log_tail()


class LocalLauncher:
    """Child processes with their output in ``log_dir/engine<k>.log``; an engine with a ``socket``
    gets its gate (`engines.gate`, ``token`` its key) on its port, logging to ``engine<k>-gate.log``."""

    can_restart = True

    def __init__(self, log_dir: str | Path, token: str | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.token = token

    def start(self, spec: EngineSpec, command: EngineCommand | None) -> EngineProcess:
        if command is None:
            raise ValueError(f"{spec.name}: a local engine needs a command")
        log.info("starting %s on %s (GPUs %s)", spec.name, spec.url, spec.gpu_ids or "none")
        gate: procs.Child | None = None
        private: list[Path] = []
        if spec.socket:
            argv, private = prepare_gate(
                spec.name, host=spec.host, port=spec.port, socket_path=spec.socket, token=self.token
            )
            gate = procs.start(f"{spec.name}-gate", argv, log_path=self.log_dir / f"{spec.name}-gate.log")
        child = procs.start(
            spec.name, command.argv, log_path=self.log_dir / f"{spec.name}.log", env=command.env
        )
        return LocalProcess(child, gate, private)


class ExternalProcess:
    """An engine someone else runs: the group can only watch it."""

    def alive(self) -> bool | None:
        return None

    def stop(self) -> None:
        return None

    def log_tail(self) -> str:
        return ""


class ExternalLauncher:
    can_restart = False

    def start(self, spec: EngineSpec, command: EngineCommand | None) -> EngineProcess:
        return ExternalProcess()


def container_spec(
    spec: EngineSpec,
    command: EngineCommand,
    *,
    image: str,
    run_id: str,
    mounts: list[str],
    token: str | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``docker.containers.run`` for one engine (Docker SDK).

    An engine with a ``socket`` runs inside the container behind its gate (`engines.gated`: Caddy
    on the engine's port, the engine on the socket, ``token`` its key in the container's
    environment), as a local engine does.

    The container gets exactly its GPUs (device request; inside it they are renumbered from 0,
    so CUDA_VISIBLE_DEVICES is dropped) with an unlimited memlock for pinned memory, and neither
    for an engine without GPUs (the CPU reference engine: the request would need NVIDIA's runtime
    on the host, the memlock a host that lets it be raised); the host's IPC and PID namespaces
    (CUDA IPC handles from the colocated trainer must open), and the host network so its URL is
    the planned one. ``mounts`` are host paths mounted at the same path (model, logs).
    """
    env = {k: v for k, v in command.env.items() if k != "CUDA_VISIBLE_DEVICES" or not spec.gpu_ids}
    # The SDK turns this mapping into a DeviceRequest (no docker import needed to build the spec).
    gpus = {"Driver": "nvidia", "DeviceIDs": [str(g) for g in spec.gpu_ids], "Capabilities": [["gpu"]]}
    argv = ["python3", *command.argv[1:]]
    if spec.socket:
        where = ["--name", spec.name, "--host", spec.host, "--port", str(spec.port), "--socket", spec.socket]
        argv = ["python3", "-m", "vime_rollout.engines.gated", *where, "--", *argv]
        if token:
            env[TOKEN_ENV] = token
    return {
        "image": image,
        "command": argv,
        "name": f"vime-{run_id}-{spec.name}",
        "detach": True,
        "environment": env,
        "ipc_mode": "host",
        "pid_mode": "host",
        "network_mode": "host",
        "shm_size": "16g",
        # pinned memory for CUDA; raising it needs a host that allows it, and a CPU engine pins nothing
        "ulimits": [{"Name": "memlock", "Soft": -1, "Hard": -1}] if spec.gpu_ids else [],
        "device_requests": [gpus] if spec.gpu_ids else [],
        "volumes": {m: {"bind": m, "mode": "ro" if i == 0 else "rw"} for i, m in enumerate(mounts)},
        "labels": {"vime.run": run_id, "vime.engine": str(spec.index)},
        "auto_remove": False,
    }


class ContainerProcess:
    """An engine container started through the Docker SDK."""

    def __init__(self, container: Any) -> None:
        self.container = container

    def alive(self) -> bool | None:
        try:
            self.container.reload()
        except Exception:  # the container is gone
            return False
        return bool(self.container.status == "running")

    def stop(self) -> None:
        try:
            self.container.stop(timeout=15)
            self.container.remove(force=True)
        except Exception as exc:
            log.warning("stopping %s: %s", self.container.name, exc)

    def log_tail(self) -> str:
        try:
            return bytes(self.container.logs(tail=40)).decode(errors="replace")
        except Exception:
            return ""


class DockerLauncher:
    """Sibling containers on the host of the rollout manager (tests/containers runs a reference
    engine through it on a real Docker engine; vLLM engines get their GPUs by device request)."""

    can_restart = True

    def __init__(
        self, run_id: str, model_path: str, log_dir: str | Path, image: str, token: str | None = None
    ) -> None:
        docker: Any
        try:
            import docker
        except ImportError:
            docker = None
        # A checkout's docker/ folder (the Dockerfiles) imports as an empty namespace package.
        if not hasattr(docker, "from_env"):
            raise RuntimeError(
                "engine.launcher=docker needs the Docker SDK: pip install 'vime-rollout[docker]'"
            )

        self.client = docker.from_env()
        self.run_id = run_id
        self.mounts = [model_path, str(log_dir)]
        self.image = image
        self.token = token

    def start(self, spec: EngineSpec, command: EngineCommand | None) -> EngineProcess:
        if command is None:
            raise ValueError(f"{spec.name}: a container engine needs a command")
        kwargs = container_spec(
            spec, command, image=self.image, run_id=self.run_id, mounts=self.mounts, token=self.token
        )
        with contextlib.suppress(Exception):  # a container of that name from an earlier life blocks the name
            self.client.containers.get(kwargs["name"]).remove(force=True)
        return ContainerProcess(self.client.containers.run(**kwargs))
