"""What one run shares between its driver loop and the REST app: status, event log, requests.

The loop updates the `RunStatus` as it goes (phase, rollout id, weight version, last step); the
app reads it and files requests the loop serves at the right moment — a stop (finish the step,
checkpoint, end), a checkpoint (at the next save point, where the trainer is awake and the
engines asleep), a weight push (at the next step boundary, where the engines are awake).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vime.config import RunConfig
from vime.wire.trainer import (
    CheckpointResult,
    PushResult,
    RunPhase,
    RunState,
    RunStatus,
    StepRecord,
    StepTimings,
)
from vime_trainer.events import EventLog


class RunEnded(RuntimeError):
    """The run ended before it served a push or checkpoint request."""


class RunContext:
    """One run's live state."""

    def __init__(self, run_id: str, cfg: RunConfig, events: EventLog) -> None:
        self.cfg = cfg
        self.events = events
        self.status = RunStatus(
            run_id=run_id,
            state=RunState.RUNNING,
            phase=RunPhase.STARTING,
            num_rollout=cfg.num_rollout,
            started_at=time.time(),
            mode=cfg.mode,
        )
        self.push_requests: list[asyncio.Future[PushResult]] = []
        self.checkpoint_requests: list[asyncio.Future[CheckpointResult]] = []

    @property
    def run_id(self) -> str:
        return self.status.run_id

    @property
    def stop_requested(self) -> bool:
        return self.status.stop_requested

    def set_phase(self, phase: RunPhase) -> None:
        self.status.phase = phase

    def set_rollout(self, rollout_id: int | None) -> None:
        self.status.rollout_id = rollout_id
        self.events.rollout_id = rollout_id

    def request_stop(self) -> None:
        if self.status.state is RunState.RUNNING:
            self.status.state = RunState.STOPPING
        self.status.stop_requested = True
        self.events.record("run.stop_requested")

    def request_push(self) -> asyncio.Future[PushResult]:
        fut: asyncio.Future[PushResult] = asyncio.get_running_loop().create_future()
        self.push_requests.append(fut)
        return fut

    def request_checkpoint(self) -> asyncio.Future[CheckpointResult]:
        fut: asyncio.Future[CheckpointResult] = asyncio.get_running_loop().create_future()
        self.checkpoint_requests.append(fut)
        return fut

    def step_done(self, step: StepRecord) -> None:
        self.status.last_step = step
        self.status.steps_done += 1
        self.status.next_rollout_id = step.rollout_id + 1

    def end(self, state: RunState, error: str | None = None) -> None:
        self.status.state = state
        self.status.phase = RunPhase.DONE
        self.status.error = error
        self.status.finished_at = time.time()
        reason = error or f"run {state.value}"
        pending: list[asyncio.Future[Any]] = [*self.push_requests, *self.checkpoint_requests]
        for fut in pending:
            if not fut.done():
                fut.set_exception(RunEnded(f"the run ended before serving the request: {reason}"))
        self.push_requests.clear()
        self.checkpoint_requests.clear()


class StepClock:
    """Times the phases of one step; T_step is the sum of the seed's six (`StepTimings`)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.ctx.set_phase(RunPhase(name))
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def timings(self) -> StepTimings:
        return StepTimings.from_phases(self.seconds)
