"""The `vime` command line (also `python -m vime`).

``vime train`` is the main job: start the services, run GRPO, show progress, print a summary.
``vime up`` starts the same stack and keeps it running; ``vime status`` and ``vime rollout`` talk
to a running stack. With no ``--config``, ``up``/``train`` use this host's embedded default
(``examples/cpu.yaml`` without a GPU) and ``status``/``rollout`` the newest stack's resolved
config (``runs/latest/config.yaml``).
"""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from vime.config import RunConfig
from vime.service_cli import ConfigOpt, SetOpt, load_or_exit

app = typer.Typer(help="vime: RL post-training (GRPO) built as services.", no_args_is_help=True)
config_app = typer.Typer(help="Inspect the run configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")

err = Console(stderr=True)
out = Console()

VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show every service log line.")]
InsecureOpt = Annotated[
    bool,
    typer.Option(
        "--insecure",
        help="Start the services with no API token, every route open (otherwise a token is generated "
        "when none is configured).",
    ),
]


def _launch_config(config: Path | None, set_: list[str] | None, insecure: bool = False) -> RunConfig:
    """``--config``, else this host's embedded default (examples/cpu.yaml without a GPU)."""
    if insecure:
        set_ = [*(set_ or []), "services.insecure=true"]
    if config is None:
        from vime.launch.defaults import default_config_path

        try:
            config = default_config_path()
        except FileNotFoundError as exc:
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(2) from None
        err.print(f"[dim]config: {config} (this host's default; --config FILE to choose)[/]", highlight=False)
    return load_or_exit(config, set_)


def _client_config(config: Path | None, set_: list[str] | None) -> RunConfig:
    """``--config``, else the newest stack's resolved config, else the defaults; the token, when
    none is configured, is the one the stack generated beside that config."""
    from vime.launch.token import token_beside

    if config is None:
        from vime.launch.stack import latest_config

        config = latest_config(load_or_exit(None, set_).output_dir)
    cfg = load_or_exit(config, set_)
    if cfg.services.token() is None and (token := token_beside(config)):
        cfg.services.api_token = token
    return cfg


@config_app.command("show")
def config_show(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the resolved config, derived values included, as JSON."""
    typer.echo(load_or_exit(config, set_).to_json())


@app.command()
def up(
    config: ConfigOpt = None, set_: SetOpt = None, verbose: VerboseOpt = False, insecure: InsecureOpt = False
) -> None:
    """Start Redis, router, reward, rollout manager (with its engines) and trainer; Ctrl-C stops all."""
    from vime.launch.stack import plan_stack
    from vime.launch.up import run_up

    raise typer.Exit(run_up(plan_stack(_launch_config(config, set_, insecure)), out, verbose=verbose))


@app.command()
def train(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    verbose: VerboseOpt = False,
    insecure: InsecureOpt = False,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="RUN_ID",
            help="Continue run RUN_ID after its newest checkpoint, in its run directory (same config "
            "and --set as the first time; a run that stops unfinished prints this command).",
        ),
    ] = None,
) -> None:
    """Start the stack, run GRPO to num_rollout with live progress, print a summary, stop the stack."""
    from vime.launch.stack import plan_stack
    from vime.launch.train import run_train

    sets = [s for s in set_ or [] if not s.replace("-", "_").startswith("run_id=")]
    cfg = _launch_config(config, [*sets, f"run_id={resume}"] if resume else set_, insecure)
    if resume and not (Path(cfg.output_dir) / resume).is_dir():
        err.print(f"[red]--resume {escape(resume)}: no run directory {Path(cfg.output_dir) / resume}[/red]")
        raise typer.Exit(2)
    plan = plan_stack(cfg)
    again = [
        "vime",
        "train",
        *(["-c", str(config)] if config else []),
        *(a for s in sets for a in ("--set", s)),
    ]
    again += [*(["--insecure"] if insecure else []), "--resume", plan.run_id]
    code = run_train(plan, out, verbose=verbose, resume=resume is not None, resume_command=shlex.join(again))
    raise typer.Exit(code)


@app.command()
def status(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Health of each service, the engines and the current run (exit 1 if anything is down)."""
    from vime.launch.status import gather, render

    st = gather(_client_config(config, set_))
    if as_json:
        typer.echo(json.dumps(st.as_dict(), indent=2))
    else:
        render(st, out)
    raise typer.Exit(0 if st.healthy else 1)


@app.command()
def rollout(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    rollout_id: Annotated[
        int,
        typer.Option(
            "--rollout-id",
            min=0,
            help="Rollout number (it names the rollout manager's job). Nothing is published and the "
            "prompts are given back, so a run started later on this stack is unaffected.",
        ),
    ] = 0,
    output: Annotated[Path | None, typer.Option("--out", "-o", help="Write all samples as JSONL.")] = None,
    show: Annotated[int, typer.Option("--show", min=0, help="Samples printed.")] = 8,
) -> None:
    """One rollout against a running `vime up`: metrics, then samples printed or saved as JSONL."""
    from vime.clients.base import ServiceCallError, ServiceUnreachable
    from vime.launch.rollout import RolloutCommandError, one_rollout, write_jsonl

    cfg = _client_config(config, set_)
    try:
        job, samples = asyncio.run(one_rollout(cfg, rollout_id))
    except (ServiceCallError, ServiceUnreachable, RolloutCommandError) as exc:
        err.print(f"[red]rollout failed: {escape(str(exc))}[/red]", soft_wrap=True)
        raise typer.Exit(1) from None
    metrics = "  ".join(f"{k.removeprefix('rollout/')}={v:.4g}" for k, v in sorted(job.metrics.items()))
    err.print(f"rollout {job.rollout_id}: {job.num_samples} samples (not published)\n{metrics}")
    if output is not None:
        write_jsonl(samples, output)
        err.print(f"samples written to {output}")
    for s in samples[:show]:
        out.print(
            f"[dim]g{s['group_index']}/{s['index']} reward {s['reward']:.2f} {s['status']}[/] "
            f"{escape(repr(s['prompt']))} → {escape(repr(s['response']))}",
            highlight=False,
        )


def main() -> None:
    """Entry point of the `vime` console script."""
    app()
