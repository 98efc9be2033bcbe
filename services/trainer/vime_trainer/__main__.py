"""``python -m vime_trainer``: the trainer service (REST; start runs with ``POST /v1/runs``).

``python -m vime_trainer run``: one run in this process, no REST — the entry point for a GPU host
where the rollout manager (with its vLLM engines), router, reward service and Redis are already
up; prints the run's summary as JSON and exits 0 when the run finished or stopped (SIGTERM or
SIGINT cancels it: 128 + the signal). Either way no Ray process outlives this one (`ray_exit`).
"""

from __future__ import annotations

import asyncio
import json
import signal
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

from vime.config import RunConfig, load_config
from vime.service import serve, start_token
from vime.service_cli import ConfigOpt, HostOpt, InsecureOpt, SetOpt, load_or_exit, run_command, setup_logging
from vime_trainer.ray_exit import keep_signal_handlers, shutdown_ray

if TYPE_CHECKING:
    from vime_trainer.runs import ConfigLoader


class Command(StrEnum):
    SERVE = "serve"
    RUN = "run"


def backend_factory(cfg: RunConfig) -> object:
    """The Megatron training ranks (Ray actors) for ``cfg``, loading the engines' checkpoint."""
    from vime.models import policy_model_path
    from vime_trainer.megatron.actor_group import ActorGroup

    return ActorGroup(cfg, str(policy_model_path(cfg)))


async def run_once(load: ConfigLoader, run_id: str | None) -> int:
    """One run; SIGTERM or SIGINT cancels it (ranks stopped) and exits 128 + the signal."""
    from vime.wire.trainer import RunRequest, RunState
    from vime_trainer.runs import RunRegistry

    registry = RunRegistry(load, backend_factory)  # type: ignore[arg-type]
    signals: list[int] = []

    def on_signal(sig: int) -> None:
        signals.append(sig)
        registry.cancel()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        handle = await registry.start(RunRequest(run_id=run_id))
        assert handle.task is not None
        if signals:  # it came while the run was being built
            registry.cancel()
        await asyncio.gather(handle.task, return_exceptions=True)  # its clean-up stops the ranks
    finally:
        await asyncio.to_thread(shutdown_ray)
    print(json.dumps(handle.ctx.status.summary, indent=2))
    if signals:
        return 128 + signals[0]
    return 0 if handle.ctx.status.state in (RunState.FINISHED, RunState.STOPPED) else 1


def main(
    command: Annotated[
        Command, typer.Argument(help="serve: the REST service; run: one run in this process, then exit.")
    ] = Command.SERVE,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    host: HostOpt = None,
    port: Annotated[int | None, typer.Option(help="Port (default: services.trainer_port).")] = None,
    run_id: Annotated[
        str | None,
        typer.Option(help="run: the run id (default: the config's or $VIME_RUN_ID, else a timestamp)."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="Python log level.")] = "info",
    insecure: InsecureOpt = False,
) -> None:
    """vime trainer: the run controller (seed steps 1–55) and the Megatron ranks."""
    keep_signal_handlers()
    cfg = load_or_exit(config, set_)
    setup_logging(log_level, "httpx")

    def load(extra: list[str]) -> RunConfig:  # a run's config: the service's with the request's fields on top
        return load_config(config, [*(set_ or []), *extra])

    if command is Command.RUN:
        raise typer.Exit(asyncio.run(run_once(load, run_id)))
    token = start_token(cfg.services, "trainer", insecure=insecure)
    from vime_trainer.app import build_app
    from vime_trainer.runs import RunRegistry

    registry = RunRegistry(load, backend_factory)  # type: ignore[arg-type]
    app = build_app(registry, token=token, on_shutdown=shutdown_ray)
    serve(app, host or cfg.services.host, port or cfg.services.trainer_port, on_signal=registry.cancel)


if __name__ == "__main__":
    run_command(main, "python -m vime_trainer")
