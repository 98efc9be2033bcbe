"""The stack's API token: the configured one (``services.api_token`` or VIME_API_TOKEN), else one
generated for the stack, so no stack `vime up` / `vime train` starts is open by default.

A generated token is printed once and kept in ``<run_dir>/api_token`` (mode 0600), where
`vime status` and `vime rollout` find it beside the resolved config. ``services.insecure`` (the
commands' ``--insecure``) starts the stack with no token at all.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from vime.config import RunConfig

TOKEN_FILE = "api_token"


def stack_token(cfg: RunConfig) -> tuple[str | None, bool]:
    """(token, generated): the configured token, a new one, or (None, False) when insecure."""
    token = cfg.services.token()
    if token:
        return token, False
    if cfg.services.insecure:
        return None, False
    return secrets.token_urlsafe(32), True


def write_token(run_dir: Path, token: str) -> Path:
    """``<run_dir>/api_token``, readable by its owner only (created 0600, never wider)."""
    path = run_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, token.encode() + b"\n")
    finally:
        os.close(fd)
    return path


def token_beside(config_path: Path | None) -> str | None:
    """The token a stack generated, from the ``api_token`` file beside its resolved config."""
    if config_path is None:
        return None
    path = Path(config_path).with_name(TOKEN_FILE)
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
