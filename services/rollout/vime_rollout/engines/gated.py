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
import time
from pathlib import Path
from types import FrameType

from vime import procs
from vime_rollout.engines.gate import prepare_gate

TOKEN_ENV = "VIME_GATE_TOKEN"
STOP_GRACE_S = 15.0
OUTPUT = "/dev/stdout"
"""Where both children write: this process's own output (a container's log)."""


def run(name: str, host: str, port: int, socket_path: str, engine_argv: list[str]) -> int:
    """Gate and engine until one of them ends; returns that one's exit code."""
    Path(socket_path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    Path(socket_path).parent.chmod(0o700)
    token = os.environ.pop(TOKEN_ENV, "") or None  # the children inherit the rest of the environment
    argv, private = prepare_gate(name, host=host, port=port, socket_path=socket_path, token=token)
    gate = procs.start(f"{name}-gate", argv, log_path=OUTPUT)
    engine = procs.start(name, engine_argv, log_path=OUTPUT)
    children = [engine, gate]

    def forward(signum: int, _frame: FrameType | None) -> None:
        for child in children:
            if child.alive():
                procs.signal_group(child.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        while all(c.alive() for c in children):
            time.sleep(0.2)
        ended = next(c for c in children if not c.alive())
        for child in children:
            child.stop(grace_s=STOP_GRACE_S)
        return int(ended.popen.returncode)
    finally:
        for path in private:
            path.unlink(missing_ok=True)


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
