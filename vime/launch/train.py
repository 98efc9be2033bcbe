"""``vime train``: ``vime up``, then one run over the trainer's REST API, followed live, then a
summary and a clean teardown.

Ctrl-C once asks the run to stop after its current step (it checkpoints and writes its records);
a second Ctrl-C stops the stack at once. A service that dies fails the run with its log tail.
"""

from __future__ import annotations

import asyncio

from rich.console import Console

from vime.clients.base import ServiceCallError, ServiceUnreachable
from vime.clients.trainer import TrainerClient
from vime.launch.progress import TrainProgress
from vime.launch.signals import SignalLatch, latched_signals
from vime.launch.stack import StackPlan
from vime.launch.summary import print_summary
from vime.launch.supervisor import StackError, StackInterrupted, Supervisor
from vime.launch.up import EXIT_FAILED, run_stack
from vime.wire.trainer import ACTIVE_STATES, RunState, RunStatus

POLL_S = 0.5


async def follow_run(
    plan: StackPlan, sup: Supervisor, latch: SignalLatch, console: Console, verbose: bool
) -> RunStatus:
    """Start the run and follow it to its end; raises StackError / StackInterrupted."""
    client = TrainerClient(plan.cfg.services.url("trainer"), token=plan.cfg.services.token(), timeout=60)
    try:
        try:
            status = await client.start_run(run_id=plan.run_id)
        except (ServiceCallError, ServiceUnreachable) as exc:
            raise StackError(f"the trainer did not start the run: {exc}") from None
        stop_sent = False
        metrics_path = plan.run_dir / "metrics.jsonl"
        with TrainProgress(console, status.num_rollout, verbose=verbose, metrics_path=metrics_path) as view:
            while status.state in ACTIVE_STATES:
                if latch.hurry:
                    raise StackInterrupted("interrupted twice")
                if latch.fired and not stop_sent:
                    stop_sent = True
                    view.note("[yellow]stopping after the current step (Ctrl-C again to stop at once)[/]")
                    await client.stop(plan.run_id)
                dead = sup.dead_child()
                if dead is not None:
                    raise StackError(sup.death_message(dead, "during the run"))
                await asyncio.sleep(POLL_S)
                status = await client.run(plan.run_id)
                events = await client.events(plan.run_id, since=max(view.last_seq, 0))
                view.update(status, events.events)
        return status
    finally:
        await client.aclose()


def run_train(plan: StackPlan, console: Console, *, verbose: bool = False) -> int:
    """The whole ``vime train``; returns the exit code (0 when the run finished or was stopped)."""
    with latched_signals() as latch:
        sup = Supervisor(plan, console, latch, verbose)
        status: RunStatus | None = None

        def train() -> int:
            nonlocal status
            status = asyncio.run(follow_run(plan, sup, latch, console, verbose))
            return 0 if status.state in (RunState.FINISHED, RunState.STOPPED) else EXIT_FAILED

        code = run_stack(sup, train)
        if sup.started:  # something ran: there may be records to sum up
            print_summary(status, plan.run_dir, console)
        return code
