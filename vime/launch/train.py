"""``vime train``: ``vime up``, then one run over the trainer's REST API, followed live, then a
summary and a clean teardown.

Ctrl-C once asks the run to stop after its current step (it checkpoints and writes its records);
a second Ctrl-C stops the stack at once. A service that dies and is not restarted
(`supervisor.RESTARTED`) fails the run with its log tail. A run that did not finish ends with the
command that continues it after its newest checkpoint (``vime train ... --resume RUN_ID``).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from rich.console import Console

from vime.clients.base import ServiceCallError, ServiceUnreachable
from vime.clients.trainer import TrainerClient
from vime.launch.progress import TrainProgress
from vime.launch.signals import SignalLatch, latched_signals
from vime.launch.stack import StackPlan
from vime.launch.summary import print_summary
from vime.launch.supervisor import StackError, StackInterrupted, Supervisor
from vime.launch.up import EXIT_FAILED, run_stack
from vime.wire.trainer import ACTIVE_STATES, RunEvent, RunState, RunStatus

POLL_S = 0.5
UNANSWERED_POLLS = 20
"""Polls in a row the trainer may leave unanswered while its process lives (it is busy, or a
connection broke) before the run counts as lost."""
CHECKPOINT_DIR = re.compile(r"^rollout_(\d+)$")


async def follow_run(
    plan: StackPlan,
    sup: Supervisor,
    latch: SignalLatch,
    console: Console,
    verbose: bool,
    *,
    resume: bool = False,
) -> RunStatus:
    """Start (or, with ``resume``, continue) the run and follow it to its end; raises StackError /
    StackInterrupted."""
    client = TrainerClient(plan.cfg.services.url("trainer"), token=plan.cfg.services.token(), timeout=60)
    try:
        try:
            status = await client.start_run(run_id=plan.run_id, resume=resume)
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
                await asyncio.sleep(POLL_S)
                status, events = await _poll(client, plan.run_id, sup, since=max(view.last_seq, 0))
                view.update(status, events)
        return status
    finally:
        await client.aclose()


async def _poll(
    client: TrainerClient, run_id: str, sup: Supervisor, *, since: int
) -> tuple[RunStatus, list[RunEvent]]:
    """The run's status and its events from ``since``. A child that died (and is not restarted)
    is the answer when the trainer gives none: its death, not a connection error, is what the
    user sees."""
    problem: Exception | None = None
    for _ in range(UNANSWERED_POLLS):
        dead = sup.check()
        if dead is not None:
            raise StackError(sup.death_message(dead, "during the run"))
        try:
            status = await client.run(run_id)
            events = await client.events(run_id, since=since)
        except (ServiceUnreachable, ServiceCallError) as exc:
            problem = exc
            await asyncio.sleep(POLL_S)
            continue
        return status, events.events
    raise StackError(f"the trainer stopped answering about run {run_id}: {problem}")


def resume_hint(plan: StackPlan, command: str | None) -> str | None:
    """The line that says how to continue the run, or why it cannot be (nothing when no run began)."""
    checkpoint = newest_checkpoint(Path(plan.cfg.trainer.checkpoint_dir) / plan.run_id)
    if checkpoint is None:
        if not (plan.run_dir / "events.jsonl").exists():
            return None
        return (
            f"run {plan.run_id} left no checkpoint to resume from (checkpoints come every "
            "save_interval rollouts, at the end, on a stop and after a fault between two steps)"
        )
    if command is None:
        return None
    return f"resume from the checkpoint of rollout {checkpoint}:  {command}"


def newest_checkpoint(root: Path) -> int | None:
    """The rollout id of the newest complete checkpoint under ``root`` (one with its state file,
    as the trainer's `latest_checkpoint` counts them), or None."""
    found = [
        int(m.group(1))
        for d in (root.iterdir() if root.is_dir() else [])
        if (m := CHECKPOINT_DIR.match(d.name)) and (d / "vime_state.json").is_file()
    ]
    return max(found, default=None)


def run_train(
    plan: StackPlan,
    console: Console,
    *,
    verbose: bool = False,
    resume: bool = False,
    resume_command: str | None = None,
) -> int:
    """The whole ``vime train``; returns the exit code (0 when the run finished or was stopped).
    ``resume_command``: the command line that continues this run, printed when it did not finish."""
    with latched_signals() as latch:
        sup = Supervisor(plan, console, latch, verbose)
        status: RunStatus | None = None

        def train() -> int:
            nonlocal status
            status = asyncio.run(follow_run(plan, sup, latch, console, verbose, resume=resume))
            return 0 if status.state in (RunState.FINISHED, RunState.STOPPED) else EXIT_FAILED

        code = run_stack(sup, train)
        if sup.started:  # something ran: there may be records to sum up
            print_summary(status, plan.run_dir, console)
            if status is None or status.state is not RunState.FINISHED:
                hint = resume_hint(plan, resume_command)
                if hint is not None:
                    console.print(hint, highlight=False, soft_wrap=True)
        return code
