"""``vllm serve`` as vime runs it: ``python -m vime_rollout.vllm_ext.serve serve MODEL ...``.

vLLM's own command line, unchanged, with two additions made before vLLM's CLI runs:

- the app its API server builds also serves `compact_generate` (``build_app`` is wrapped; vLLM
  looks it up when it serves). That reaches the one API server process each engine vime starts has
  (no ``--api-server-count``). A vLLM whose internals the route cannot import serves without it,
  and the rollout manager, which checks each engine for the route at start, posts to vLLM's own;
- ``/pause`` answers once the scheduler is paused, without vLLM 0.26's fixed 20 ms wait
  (`quick_pause`); another vLLM keeps its own.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vime.engine")


def _quick_pause() -> None:
    try:
        from vime_rollout.vllm_ext.quick_pause import install

        reason = install()
    except ImportError as exc:
        reason = str(exc)
    if reason is not None:
        log.warning("vLLM's own /pause (with its 20 ms wait) on this vLLM: %s", reason)


def main() -> None:
    import vllm.entrypoints.openai.api_server as api_server
    from vllm.entrypoints.cli.main import main as vllm_main

    _quick_pause()
    try:
        from vime_rollout.vllm_ext.compact_generate import attach
    except ImportError as exc:  # another vLLM's internals: serve without it (the manager uses vLLM's route)
        log.warning("no compact generate route on this vLLM: %s", exc)
        vllm_main()
        return
    build_app = api_server.build_app

    def build_app_with_compact_route(*args: Any, **kwargs: Any) -> Any:
        return attach(build_app(*args, **kwargs))

    api_server.build_app = build_app_with_compact_route
    vllm_main()


if __name__ == "__main__":
    main()
