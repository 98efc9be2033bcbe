"""Ray never outlives the trainer service: its handlers stay in charge of SIGTERM, and every way out
(SIGTERM, SIGINT, the end of a ``run``) ends with ``ray.shutdown()``.

The first run starts a local Ray from a worker thread (`ActorGroup.start`). Ray's driver then
installs abseil's failure-signal handler on SIGTERM, which arms a 3-second SIGABRT before passing
the signal on, so the graceful shutdown (cancel the run, stop the ranks, shut Ray down) is cut
short and Ray's agents and idle workers (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``,
``ray::IDLE``, outside the service's process group) are left running. Switching that handler off
(``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``, read when Ray is imported; Ray's processes inherit it)
leaves the signals to uvicorn (``serve``) or to `run_once`'s handlers (``run``).
"""

from __future__ import annotations

import os
import sys

FAILURE_HANDLER_SWITCH = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"


def keep_signal_handlers() -> None:
    """Call before anything imports Ray (an explicit setting in the environment is kept)."""
    os.environ.setdefault(FAILURE_HANDLER_SWITCH, "1")


def shutdown_ray() -> None:
    """Stop the local Ray this process started (its raylet, GCS, agents and workers), if any."""
    if "ray" not in sys.modules:
        return  # no run ever started: Ray was never imported, let alone started
    import ray

    if ray.is_initialized():
        ray.shutdown()
