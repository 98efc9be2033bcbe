"""Rollout jobs: one runs at a time; a repeated request for a running or finished rollout gets the
same job back, so a trainer that retries after a dropped connection does not generate twice. An
unpublished rollout (a preview: ``publish=False``, a one-off look) is never such a job, nor gets one
back, and neither is a job made before the current run said it was ready (`JobRegistry.new_run`):
a rollout requested out of band, before a run, never stands in for that run's rollout of the same
id (its samples came from weights the run never pushed).

A job runs in its own task, independent of the HTTP request that started it: a client that
disconnects from a blocking ``POST /v1/rollouts`` does not cancel the rollout.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from vime.wire.rollout import JobState, RolloutJob

MAX_KEPT_JOBS = 64


class JobConflict(RuntimeError):
    """Another rollout is running."""


class JobRegistry:
    """Jobs by id, plus the one currently running."""

    def __init__(self, run_id: str | None = None) -> None:
        self.run_id = run_id
        """Stamped on every job: the run whose Redis stream the batches go to."""
        self.jobs: OrderedDict[str, RolloutJob] = OrderedDict()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.running: RolloutJob | None = None
        self._before_run: set[str] = set()
        """Jobs made before the current run's `new_run`: never the answer to a later request."""

    def get(self, job_id: str) -> RolloutJob | None:
        return self.jobs.get(job_id)

    def find(self, rollout_id: int, evaluation: bool) -> RolloutJob | None:
        """The running or finished (not failed) job of this rollout made since the current run began,
        newest first; never a preview."""
        for job in reversed(self.jobs.values()):
            if (
                job.rollout_id == rollout_id
                and job.evaluation == evaluation
                and not job.preview
                and job.state is not JobState.FAILED
                and job.job_id not in self._before_run
            ):
                return job
        return None

    def new_run(self) -> None:
        """A run is ready to train (``POST /v1/training-ready``): every job made so far is out of
        band for it; finished ones are dropped, a running one finishes but is never handed out."""
        self.forget_finished()
        self._before_run = set(self.jobs)

    def submit(
        self,
        rollout_id: int,
        evaluation: bool,
        run: Callable[[RolloutJob], Awaitable[None]],
        preview: bool = False,
    ) -> tuple[RolloutJob, bool]:
        """(job, created): an existing job of this rollout, or a new one started in its own task (a
        preview always gets a new one)."""
        existing = None if preview else self.find(rollout_id, evaluation)
        if existing is not None:
            return existing, False
        if self.running is not None:
            kind = "evaluation" if self.running.evaluation else "rollout"
            raise JobConflict(
                f"{kind} {self.running.rollout_id} (job {self.running.job_id}) is still running; "
                "one rollout runs at a time"
            )
        job = RolloutJob(
            job_id=uuid.uuid4().hex[:12],
            rollout_id=rollout_id,
            evaluation=evaluation,
            run_id=self.run_id,
            created_at=time.time(),
            preview=preview,
        )
        self.jobs[job.job_id] = job
        while len(self.jobs) > MAX_KEPT_JOBS:
            self._before_run.discard(self.jobs.popitem(last=False)[0])
        self.running = job
        self.tasks[job.job_id] = asyncio.create_task(self._run(job, run), name=f"rollout-{job.job_id}")
        return job, True

    async def _run(self, job: RolloutJob, run: Callable[[RolloutJob], Awaitable[None]]) -> None:
        try:
            await run(job)
            job.state = JobState.DONE
        except asyncio.CancelledError:
            job.state, job.error = JobState.FAILED, "cancelled (the rollout manager is shutting down)"
            raise
        except Exception as exc:
            job.state, job.error = JobState.FAILED, f"{type(exc).__name__}: {exc}"
        finally:
            job.finished_at = time.time()
            self.running = None
            self.tasks.pop(job.job_id, None)

    async def wait(self, job: RolloutJob) -> RolloutJob:
        """Wait for a job to finish (shielded: the caller going away does not cancel it)."""
        task = self.tasks.get(job.job_id)
        if task is not None:
            await asyncio.shield(task)
        return job

    def forget_finished(self) -> None:
        """Drop finished jobs (after a data-source restore the same rollout ids are generated anew)."""
        for job_id in [j for j, job in self.jobs.items() if job.state is not JobState.RUNNING]:
            del self.jobs[job_id]
            self._before_run.discard(job_id)

    async def cancel_all(self) -> None:
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
