"""``python -m vime_reward [--config FILE] [--set key=value ...] [--host H] [--port P]``."""

from __future__ import annotations

import argparse
import logging
import sys

from vime.config import ConfigError, load_config
from vime.service import INSECURE_HELP, serve, start_token


def main(argv: list[str] | None = None) -> int:
    """Load the run config and serve the reward API on its host and port."""
    parser = argparse.ArgumentParser(prog="python -m vime_reward", description="vime reward service")
    parser.add_argument("--config", help="run config YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--host", help="interface to bind (default: services.host)")
    parser.add_argument("--port", type=int, help="port (default: services.reward_port)")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from vime_reward.app import build_app

    app = build_app(cfg, token=start_token(cfg.services, "reward", insecure=args.insecure))
    serve(app, args.host or cfg.services.host, args.port or cfg.services.reward_port, args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
