"""``python -m vime_trainer``: the trainer service (REST; start runs with ``POST /v1/runs``).

``python -m vime_trainer run``: one run in this process, no REST — the entry point for a GPU host
where the rollout manager (with its vLLM engines), router, reward service and Redis are already
up; prints the run's summary as JSON and exits 0 when the run finished or stopped (SIGTERM or
SIGINT cancels it: 128 + the signal). Either way no Ray process outlives this one (`ray_exit`).

Defaults come from the run config's ``services`` section; ``--set key=value`` overrides any field.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

from vime.config import ConfigError, RunConfig, load_config
from vime.service import INSECURE_HELP, serve, start_token
from vime_trainer.ray_exit import keep_signal_handlers, shutdown_ray


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vime_trainer", description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", choices=("serve", "run"), default="serve")
    p.add_argument("--config", type=Path, default=None, help="YAML run config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--host", default=None, help="interface to bind (default: services.host)")
    p.add_argument("--port", type=int, default=None, help="port (default: services.trainer_port)")
    p.add_argument(
        "--run-id",
        default=None,
        help="run: the run id (default: the config's or $VIME_RUN_ID, else a timestamp)",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument("--insecure", action="store_true", help=f"serve: {INSECURE_HELP}")
    return p.parse_args(argv)


def backend_factory(cfg: RunConfig) -> object:
    """The Megatron training ranks (Ray actors) for ``cfg``, loading the engines' checkpoint."""
    from vime.models import policy_model_path
    from vime_trainer.megatron.actor_group import ActorGroup

    return ActorGroup(cfg, str(policy_model_path(cfg)))


async def run_once(args: argparse.Namespace) -> int:
    """One run; SIGTERM or SIGINT cancels it (ranks stopped) and exits 128 + the signal."""
    from vime.wire.trainer import RunRequest, RunState
    from vime_trainer.runs import RunRegistry

    registry = RunRegistry(lambda extra: load_config(args.config, [*args.overrides, *extra]), backend_factory)  # type: ignore[arg-type]
    signals: list[int] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.append, sig)
    try:
        handle = await registry.start(RunRequest(run_id=args.run_id))
        assert handle.task is not None
        while not handle.task.done() and not signals:
            await asyncio.wait({handle.task}, timeout=0.2)
        await registry.aclose()  # cancels the run if a signal came first; its clean-up stops the ranks
    finally:
        await asyncio.to_thread(shutdown_ray)
    print(json.dumps(handle.ctx.status.summary, indent=2))
    if signals:
        return 128 + signals[0]
    return 0 if handle.ctx.status.state in (RunState.FINISHED, RunState.STOPPED) else 1


def main(argv: list[str] | None = None) -> None:
    keep_signal_handlers()
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
    if args.command == "run":
        raise SystemExit(asyncio.run(run_once(args)))
    token = start_token(cfg.services, "trainer", insecure=args.insecure)
    from vime_trainer.app import build_app
    from vime_trainer.runs import RunRegistry

    registry = RunRegistry(lambda extra: load_config(args.config, [*args.overrides, *extra]), backend_factory)  # type: ignore[arg-type]
    app = build_app(registry, token=token, on_shutdown=shutdown_ray)
    serve(app, args.host or cfg.services.host, args.port or cfg.services.trainer_port)


if __name__ == "__main__":
    main()
