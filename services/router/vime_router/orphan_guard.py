"""Exec a command that dies with its parent: ``python -m vime_router.orphan_guard CMD [ARGS...]``.

The router service starts vllm-router and the route filter in their own process groups so it can
stop each one alone. If the service itself is SIGKILLed it cannot stop them, and an orphaned
vllm-router would keep serving (and hold the public port). On Linux the kernel's parent-death
signal (``PR_SET_PDEATHSIG``, kept across exec) sends them SIGTERM instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m vime_router.orphan_guard CMD [ARGS...]")
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        expected = os.environ.get("VIME_PARENT_PID")
        if expected and os.getppid() != int(expected):
            raise SystemExit("parent exited before the child started")
    os.execvp(args[0], args)


if __name__ == "__main__":
    main()
