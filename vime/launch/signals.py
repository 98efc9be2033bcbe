"""Ctrl-C and SIGTERM as something the launcher's loops poll, not an exception thrown mid-step.

The launcher must finish what it is doing (start a child, write a file) and then tear down in
order; an exception raised inside ``Popen`` or a health poll could leave a child unrecorded. The
first signal asks for a clean stop; a second one asks to hurry (kill instead of wait).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class SignalLatch:
    """Records SIGINT/SIGTERM; ``fired`` after the first, ``hurry`` after the second."""

    def __init__(self) -> None:
        self.count = 0
        self.signum: int | None = None
        self.event = threading.Event()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        self.signum = self.signum or signum
        self.event.set()

    @property
    def fired(self) -> bool:
        return self.count > 0

    @property
    def hurry(self) -> bool:
        return self.count > 1

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``, waking early on a signal; True if one has fired."""
        return self.event.wait(timeout_s)

    def exit_code(self) -> int:
        """128 + the first signal's number (130 for Ctrl-C, 143 for SIGTERM)."""
        return 128 + (self.signum or signal.SIGINT)


@contextmanager
def latched_signals() -> Iterator[SignalLatch]:
    """Install the latch for SIGINT and SIGTERM in this (main) thread; restore the old handlers."""
    latch = SignalLatch()
    old = {sig: signal.signal(sig, latch._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield latch
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
