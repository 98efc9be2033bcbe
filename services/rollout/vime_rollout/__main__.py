"""``python -m vime_rollout``: the rollout manager service (starts its engines, then serves).

Defaults come from the run config's ``services`` section; ``--set key=value`` overrides any field.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from vime.config import ConfigError, load_config
from vime.service import INSECURE_HELP, serve, start_token


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vime_rollout", description=__doc__)
    p.add_argument("--config", type=Path, default=None, help="YAML run config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--host", default=None, help="interface to bind (default: services.host)")
    p.add_argument("--port", type=int, default=None, help="port (default: services.rollout_port)")
    p.add_argument(
        "--log-dir", type=Path, default=None, help="engine logs (default: <output_dir>/<run>/logs)"
    )
    p.add_argument("--log-level", default="info")
    p.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call drowns the log
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
    token = start_token(cfg.services, "rollout", insecure=args.insecure)
    from vime_rollout.app import build_app
    from vime_rollout.factory import build_manager
    from vime_rollout.manager import RolloutManager

    async def start() -> RolloutManager:
        return await build_manager(cfg, log_dir=args.log_dir)

    app = build_app(start, token=token, default_dp_size=cfg.dp_size)
    host = args.host or cfg.services.host
    port = args.port or cfg.services.rollout_port
    serve(app, host, port, log_level="info" if args.log_level.lower() == "debug" else "warning")


if __name__ == "__main__":
    main()
