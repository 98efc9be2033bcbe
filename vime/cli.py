"""The `vime` command line (also `python -m vime`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from vime.config import ConfigError, load_config

app = typer.Typer(help="vime: RL post-training (GRPO) built as services.", no_args_is_help=True)
config_app = typer.Typer(help="Inspect the run configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")

err = Console(stderr=True)

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML run config.")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override: key=value (dotted for sections).")
]


@config_app.command("show")
def config_show(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the resolved config, derived values included, as JSON."""
    try:
        cfg = load_config(config, set_ or [])
    except ConfigError as exc:
        err.print(f"[red]{exc}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    typer.echo(cfg.to_json())


def main() -> None:
    """Entry point of the `vime` console script."""
    app()
