"""``python -m vime_router [--config FILE] [--set key=value ...] [--host H] [--port P] [--data-port D]``.

Starts both planes: the control plane (this process, FastAPI on ``services.router_control_port``)
and the data plane it supervises (the route filter on ``services.router_port`` in front of
vllm-router on a private loopback port).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from vime.config import ConfigError, load_config
from vime.service import INSECURE_HELP, serve, start_token
from vime_router.app import build_app
from vime_router.data_plane import DataPlaneSpec
from vime_router.service import RouterService


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vime_router", description=__doc__)
    p.add_argument("--config", help="run config YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--host", help="interface both planes bind (default services.host)")
    p.add_argument("--port", type=int, help="control-plane port (default services.router_control_port)")
    p.add_argument("--data-port", type=int, help="public data-plane port (default services.router_port)")
    p.add_argument("--log-dir", help="where vllm-router's and the filter's logs go (default: a temp dir)")
    p.add_argument("--log-level", default="info", help="lifecycle at info; ejections and failures at warning")
    p.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health probe drowns the log
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    services = cfg.services
    token = start_token(services, "router", insecure=args.insecure)
    host = args.host or services.host
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="vime-router-"))
    spec = DataPlaneSpec(
        host=host, port=args.data_port or services.router_port, config=cfg.router, log_dir=log_dir
    )
    logging.getLogger("vime.router").info(
        "router: data plane %s (policy %s), control plane http://%s:%d, logs in %s",
        spec.public_url,
        cfg.router.policy,
        host,
        args.port or services.router_control_port,
        log_dir,
    )
    app = build_app(RouterService(cfg.router, spec), token)
    serve(app, host, args.port or services.router_control_port)


if __name__ == "__main__":
    main()
