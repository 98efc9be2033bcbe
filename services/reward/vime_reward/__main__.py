"""``python -m vime_reward``: the reward service on ``services.reward_port``."""

from __future__ import annotations

from typing import Annotated

import typer

from vime.service import serve, start_token
from vime.service_cli import ConfigOpt, HostOpt, InsecureOpt, SetOpt, load_or_exit, run_command, setup_logging


def main(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    host: HostOpt = None,
    port: Annotated[int | None, typer.Option(help="Port (default: services.reward_port).")] = None,
    log_level: Annotated[str, typer.Option(help="Python log level.")] = "warning",
    insecure: InsecureOpt = False,
) -> None:
    """vime reward service: scores samples (POST /v1/rewards)."""
    cfg = load_or_exit(config, set_)
    setup_logging(log_level)
    from vime_reward.app import build_app

    serve(
        build_app(cfg, token=start_token(cfg.services, "reward", insecure=insecure)),
        host or cfg.services.host,
        port or cfg.services.reward_port,
        log_level,
    )


if __name__ == "__main__":
    run_command(main, "python -m vime_reward")
