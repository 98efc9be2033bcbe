"""``python -m vime_router``: both planes of the router.

The control plane (this process, FastAPI on ``services.router_control_port``) and the data plane
it supervises (the route filter on ``services.router_port`` in front of vllm-router on a private
loopback port).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from vime.service import serve, start_token
from vime.service_cli import ConfigOpt, HostOpt, InsecureOpt, SetOpt, load_or_exit, run_command, setup_logging


def main(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    host: HostOpt = None,
    port: Annotated[
        int | None, typer.Option(help="Control-plane port (default: services.router_control_port).")
    ] = None,
    data_port: Annotated[
        int | None, typer.Option(help="Public data-plane port (default: services.router_port).")
    ] = None,
    log_dir: Annotated[
        Path | None, typer.Option(help="Where vllm-router's and the filter's logs go (default: a temp dir).")
    ] = None,
    log_level: Annotated[
        str, typer.Option(help="Lifecycle at info; ejections and failures at warning.")
    ] = "info",
    insecure: InsecureOpt = False,
) -> None:
    """vime router: the engines behind one generate API, control routes never forwarded."""
    cfg = load_or_exit(config, set_)
    setup_logging(log_level, "httpx")  # one line per health probe drowns the log
    from vime_router.app import build_app
    from vime_router.data_plane import DataPlaneSpec
    from vime_router.service import RouterService

    services = cfg.services
    token = start_token(services, "router", insecure=insecure)
    host = host or services.host
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="vime-router-"))
    spec = DataPlaneSpec(
        host=host, port=data_port or services.router_port, config=cfg.router, log_dir=log_dir
    )
    control_port = port or services.router_control_port
    logging.getLogger("vime.router").info(
        "router: data plane %s (policy %s), control plane http://%s:%d, logs in %s",
        spec.public_url,
        cfg.router.policy,
        host,
        control_port,
        log_dir,
    )
    serve(build_app(RouterService(cfg.router, spec), token), host, control_port)


if __name__ == "__main__":
    run_command(main, "python -m vime_router")
