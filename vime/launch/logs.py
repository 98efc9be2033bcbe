"""The console view of the services' logs: every ``*.log`` in the run's log directory, followed
by a background thread and printed with a coloured ``[service]`` prefix.

The full output stays in the files (``runs/<run_id>/logs/<service>.log``); the console shows only
what needs a human — warnings, errors and tracebacks — unless ``verbose``.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

COLOURS = {
    "redis": "red",
    "router": "cyan",
    "vllm-router": "cyan",
    "route-filter": "cyan",
    "reward": "magenta",
    "rollout": "green",
    "trainer": "yellow",
}
ENGINE_COLOUR = "blue"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
IGNORED = re.compile(
    r"Memory overcommit must be enabled"  # redis-server in containers
    r"|SIGTERM handler is not set because current thread is not the main thread"  # Ray in a thread
    r"|Token authentication is enabled for this Ray cluster"
)
"""Known-harmless warnings kept out of the console (still in the log files)."""
NOTABLE = re.compile(r"\b(WARNING|WARN|ERROR|CRITICAL|FATAL|Traceback|[A-Za-z]*Error|[A-Za-z]*Exception)\b")


def colour_of(name: str) -> str:
    return COLOURS.get(name, ENGINE_COLOUR if name.startswith("engine") else "white")


@dataclass
class _Followed:
    path: Path
    offset: int = 0
    partial: str = ""
    in_traceback: bool = False


class LineFilter:
    """Decides which log lines reach the console: notable lines and whole tracebacks."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose

    def keep(self, state: _Followed, line: str) -> bool:
        if self.verbose:
            return True
        if IGNORED.search(line):
            return False
        if state.in_traceback:
            # A traceback ends with its first unindented line after the header (the exception).
            if line and not line[0].isspace():
                state.in_traceback = False
            return True
        if line.startswith("Traceback"):
            state.in_traceback = True
            return True
        return bool(NOTABLE.search(line))


@dataclass
class LogFollower:
    """Follows every ``*.log`` under ``log_dirs`` (new files included) until stopped."""

    log_dirs: list[Path]
    console: Console
    verbose: bool = False
    interval_s: float = 0.25
    _files: dict[Path, _Followed] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        for path in self._discover():  # what is already there is history, not news
            self._files[path] = _Followed(path, offset=path.stat().st_size)
        self._thread = threading.Thread(target=self._run, name="vime-logs", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll()  # the last lines (often the reason a child died)

    def _discover(self) -> list[Path]:
        return sorted(p for d in self.log_dirs if d.is_dir() for p in d.glob("*.log"))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        """Print what was appended to each file since the last poll."""
        filt = LineFilter(self.verbose)
        for path in self._discover():
            state = self._files.setdefault(path, _Followed(path))
            for line in self._new_lines(state):
                if filt.keep(state, line):
                    name = path.stem
                    self.console.print(
                        f"[{colour_of(name)}]{name:>12}[/] │ {escape(line)}", highlight=False, soft_wrap=True
                    )

    @staticmethod
    def _new_lines(state: _Followed) -> list[str]:
        try:
            with state.path.open("rb") as f:
                f.seek(state.offset)
                data = f.read()
        except OSError:
            return []
        state.offset += len(data)
        text = state.partial + data.decode(errors="replace")
        *lines, state.partial = text.split("\n")
        return [ANSI.sub("", ln).rstrip("\r") for ln in lines]
