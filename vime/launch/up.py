"""``vime up``: start the stack, keep it running until Ctrl-C / SIGTERM / a child's failure."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console

from vime.launch.signals import SignalLatch, latched_signals
from vime.launch.stack import StackPlan
from vime.launch.supervisor import StackError, StackInterrupted, Supervisor
from vime.launch.token import TOKEN_FILE

EXIT_FAILED = 1


def print_banner(plan: StackPlan, console: Console) -> None:
    """Where everything is, once the stack is healthy (and the token, when it was generated)."""
    s = plan.cfg.services
    if plan.token_generated:
        access = f"  token  {s.api_token}  (generated; kept in {plan.run_dir / TOKEN_FILE}, mode 0600)\n"
    elif s.insecure:
        access = "  [yellow]insecure: no API token, every route is open[/]\n"
    else:
        access = ""
    console.print(
        f"[bold green]stack {plan.run_id} is up[/]  router {s.url('router')}  rollout {s.url('rollout')}  "
        f"trainer {s.url('trainer')}\n"
        f"{access}"
        f"  logs   {plan.log_dir}/\n"
        f"  config {plan.config_path}  (vime status -c {plan.config_path})",
        highlight=False,
        soft_wrap=True,
    )


def watch(sup: Supervisor, latch: SignalLatch) -> int:
    """Block until a signal (128 + signum) or the death of a child that is not restarted (1, with
    its log tail printed)."""
    while not latch.wait(0.5):
        dead = sup.check()
        if dead is not None:
            sup.console.print(f"[red]✗ {sup.death_message(dead)}[/]", highlight=False)
            return EXIT_FAILED
    return latch.exit_code()


def run_stack(sup: Supervisor, body: Callable[[], int]) -> int:
    """Start the stack, say where it is, then ``body()`` gives the exit code; a signal while starting
    (128 + signum) or a failed stack (1, the reason printed) ends it early. The stack always stops."""
    try:
        sup.start()
        print_banner(sup.plan, sup.console)
        return body()
    except StackInterrupted:
        return sup.latch.exit_code()
    except StackError as exc:
        sup.console.print(f"[red]✗ {exc}[/]", highlight=False)
        return EXIT_FAILED
    finally:
        sup.stop()


def run_up(plan: StackPlan, console: Console, *, verbose: bool = False) -> int:
    """The whole ``vime up``; returns the process exit code."""
    with latched_signals() as latch:
        sup = Supervisor(plan, console, latch, verbose)

        def hold() -> int:
            console.print("[dim]Ctrl-C stops everything[/]")
            return watch(sup, latch)

        return run_stack(sup, hold)
