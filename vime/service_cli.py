"""What every vime command line shares: the ``--config`` / ``--set`` options, loading the run
config with one exit code for a config that cannot be loaded (`BAD_CONFIG`, as `vime` exits), and
`run_command`, which runs a service's ``python -m`` entry point (reward, router, rollout manager,
trainer, reference engine) as a typer command, so ``--help`` and bad options behave alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from vime.config import ConfigError, RunConfig, load_config
from vime.service import INSECURE_HELP

BAD_CONFIG = 2
"""Exit code of every vime command whose run config cannot be loaded (click's usage-error code)."""

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML run config.")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override: key=value (dotted for sections).")
]
HostOpt = Annotated[str | None, typer.Option("--host", help="Interface to bind (default: services.host).")]
InsecureOpt = Annotated[bool, typer.Option("--insecure", help=INSECURE_HELP.capitalize() + ".")]


def load_or_exit(config: Path | None, overrides: list[str] | None) -> RunConfig:
    """The run config of ``config`` + environment + ``overrides``; exits `BAD_CONFIG` saying why not."""
    try:
        return load_config(config, overrides or [])
    except ConfigError as exc:
        Console(stderr=True).print(f"[red]{escape(str(exc))}[/red]", soft_wrap=True)
        raise typer.Exit(BAD_CONFIG) from None


def setup_logging(level: str, *quiet: str) -> None:
    """Log lines with time and logger name at ``level``; the ``quiet`` loggers only from warnings up."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)


def run_command(command: Callable[..., Any], prog: str) -> None:
    """``python -m <prog>``: parse the command line into ``command``'s typer options and run it."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    app.command(help=command.__doc__)(command)
    app(prog_name=prog)
