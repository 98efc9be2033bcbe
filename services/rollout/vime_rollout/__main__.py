"""``python -m vime_rollout``: the rollout manager service (starts its engines, then serves)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vime.service import serve, start_token
from vime.service_cli import ConfigOpt, HostOpt, InsecureOpt, SetOpt, load_or_exit, run_command, setup_logging


def main(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    host: HostOpt = None,
    port: Annotated[int | None, typer.Option(help="Port (default: services.rollout_port).")] = None,
    log_dir: Annotated[
        Path | None, typer.Option(help="Engine logs (default: <output_dir>/<run>/logs).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="Python log level.")] = "info",
    insecure: InsecureOpt = False,
) -> None:
    """vime rollout manager: starts the engines, serves rollouts, publishes batches to Redis."""
    cfg = load_or_exit(config, set_)
    setup_logging(log_level, "httpx")  # one line per engine call drowns the log
    token = start_token(cfg.services, "rollout", insecure=insecure)
    from vime_rollout.app import build_app
    from vime_rollout.factory import build_manager
    from vime_rollout.manager import RolloutManager

    async def start() -> RolloutManager:
        return await build_manager(cfg, log_dir=log_dir)

    app = build_app(start, token=token, default_dp_size=cfg.dp_size)
    serve(
        app,
        host or cfg.services.host,
        port or cfg.services.rollout_port,
        log_level="info" if log_level.lower() == "debug" else "warning",
    )


if __name__ == "__main__":
    run_command(main, "python -m vime_rollout")
