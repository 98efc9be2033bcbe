"""An engine and its gate as one process: how an engine in a container (``engine.launcher=docker``)
gets the gate a local engine has (`engines.gate`).

    python -m vime_rollout.engines.gated --name engine0 --host H --port P --socket S -- ENGINE ARGV...

Starts Caddy on ``H:P`` with the gate's configuration (the token from ``VIME_GATE_TOKEN``, removed
from the engine's environment; none: the gate passes everything) and the engine, whose argv
listens on the Unix socket ``S`` (``--uds S``), in a directory only this user can enter. Both
write to this process's output (the container's log). It ends when either child ends, stopping
the other, with that child's exit code; SIGTERM and SIGINT go to both children (as a container's
first process it must pass them on: PID 1 has no default action for them).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path
from types import FrameType

from vime_rollout.engines.gate import gate_argv

TOKEN_ENV = "VIME_GATE_TOKEN"
STOP_GRACE_S = 15.0


def _stop(child: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if child.poll() is None:
        child.send_signal(sig)
        try:
            child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def run(name: str, host: str, port: int, socket_path: str, engine_argv: list[str]) -> int:
    """Gate and engine until one of them ends; returns that one's exit code."""
    socket = Path(socket_path)
    socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    socket.parent.chmod(0o700)
    socket.unlink(missing_ok=True)  # an earlier life's socket: the engine's bind would fail
    env = dict(os.environ)
    token = env.pop(TOKEN_ENV, "") or None
    argv = gate_argv(socket.parent, name, host=host, port=port, socket_path=str(socket), token=token)
    gate = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    engine = subprocess.Popen(engine_argv, env=env, stdin=subprocess.DEVNULL)
    children = [engine, gate]

    def forward(signum: int, _frame: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        while all(c.poll() is None for c in children):
            time.sleep(0.2)
        ended = next(c for c in children if c.returncode is not None)
        for child in children:
            _stop(child)
        return int(ended.returncode)
    finally:
        socket.unlink(missing_ok=True)
        Path(argv[-1]).unlink(missing_ok=True)  # the gate's configuration holds the token


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="the engine's name (names the gate's configuration)")
    p.add_argument("--host", required=True, help="the gate's interface")
    p.add_argument("--port", type=int, required=True, help="the gate's port")
    p.add_argument("--socket", required=True, help="the Unix socket the engine listens on")
    p.add_argument("engine", nargs=argparse.REMAINDER, help="-- then the engine's argv")
    args = p.parse_args(argv)
    engine = args.engine[1:] if args.engine[:1] == ["--"] else args.engine
    if not engine:
        p.error("give the engine's argv after --")
    return run(args.name, args.host, args.port, args.socket, engine)


if __name__ == "__main__":
    raise SystemExit(main())
