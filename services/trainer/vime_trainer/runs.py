"""Runs of this trainer service: one active at a time, each a background task driving `Controller`.

A run is active from ``POST /v1/runs`` until its task has fully ended — ranks shut down, report
drawn — so a second run can never find the first one's ranks still holding the GPUs. Its config
is the service's config with the request's fields on top (only those the run applies,
`run_overrides`); its checkpoints go to ``<trainer.checkpoint_dir>/<run_id>`` so a run id resumes
its own checkpoints.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vime.clients.base import ServiceCallError, ServiceUnreachable
from vime.clients.rollout import RolloutClient
from vime.config import ConfigError, RunConfig
from vime.service import ServiceError
from vime.wire.trainer import ACTIVE_STATES, RunRequest, RunState, StepRecord
from vime_trainer.async_controller import AsyncController
from vime_trainer.controller import Controller
from vime_trainer.events import EventLog
from vime_trainer.megatron.checkpoint import latest_checkpoint
from vime_trainer.ops import Backend, RunOps
from vime_trainer.record import RunRecord
from vime_trainer.report import draw_report, summarize, warmup_summary
from vime_trainer.run_overrides import check_overrides
from vime_trainer.state import RunContext
from vime_trainer.weight_sync import make_weight_sync

log = logging.getLogger("vime.trainer.run")

ConfigLoader = Callable[[list[str]], RunConfig]
"""Loads the service's config with extra ``key=value`` overrides on top."""
BackendFactory = Callable[[RunConfig], Backend]


def override_pairs(config: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """``{"trainer": {"lr": 1e-4}}`` → ``trainer.lr=0.0001`` (values as JSON, which YAML reads back)."""
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from override_pairs(value, dotted + ".")
        else:
            yield f"{dotted}={json.dumps(value)}"


def run_config(load: ConfigLoader, request: RunRequest) -> RunConfig:
    """The service config + the request's fields; run id and per-run checkpoint directory set."""
    try:
        check_overrides(request.config, load([]))
        cfg = load(list(override_pairs(request.config)))
    except ConfigError as exc:
        raise ServiceError(422, str(exc)) from None
    run_id = request.run_id or cfg.effective_run_id(default=time.strftime("run-%Y%m%d-%H%M%S"))
    if request.resume and cfg.start_rollout_id is not None:
        raise ServiceError(
            422, "start_rollout_id: a resumed run continues after its newest checkpoint; leave it unset"
        )
    if not cfg.services.redis_url:
        raise ServiceError(422, "services.redis_url is not set: the trainer reads rollout batches from Redis")
    trainer = cfg.trainer.model_copy(
        update={"checkpoint_dir": str(Path(cfg.trainer.checkpoint_dir) / run_id)}
    )
    return cfg.model_copy(update={"run_id": run_id, "trainer": trainer})


def first_rollout(cfg: RunConfig, resume: bool) -> int:
    """The rollout a run starts at: ``start_rollout_id``, else the one after the newest checkpoint
    of its run id (what the controller loads), else 0; a ``resume`` with no checkpoint is a 409."""
    if cfg.start_rollout_id is not None:
        return cfg.start_rollout_id
    found = latest_checkpoint(cfg.trainer.checkpoint_dir)
    if found is None and resume:
        raise ServiceError(
            409, f"run {cfg.run_id}: no checkpoint under {cfg.trainer.checkpoint_dir} to resume from"
        )
    return int(found[1]["next_rollout_id"]) if found else 0


async def check_mode(cfg: RunConfig) -> None:
    """409 when the rollout manager was started for the other loop: ``mode`` reaches it only at its
    start. A manager that does not answer yet is checked again when the run starts."""
    client = RolloutClient(cfg.services.url("rollout"), token=cfg.services.token(), timeout=10, retries=0)
    try:
        status = await client.engines()
    except (ServiceUnreachable, ServiceCallError):
        return
    finally:
        await client.aclose()
    if status.mode != cfg.mode:
        raise ServiceError(
            409,
            f"config.mode: the run asks for mode={cfg.mode}, but the rollout manager was started with "
            f"mode={status.mode}; restart the stack with mode={cfg.mode} to run it",
            field="mode",
        )


class RunHandle:
    """One run: its context, controller and task."""

    def __init__(
        self, cfg: RunConfig, backend: Backend, on_step: Callable[[StepRecord], None], first: int = 0
    ) -> None:
        """``first``: the rollout it starts at; the records of earlier legs of this run id from
        there on are superseded (`RunRecord.supersede`)."""
        run_id = cfg.run_id or "run"
        self.record = RunRecord(cfg, run_id)
        self.record.supersede(first)
        self.ctx = RunContext(run_id, cfg, EventLog(self.record.events_path))
        services = cfg.services
        self.rollout = RolloutClient(services.url("rollout"), token=services.token())
        self.ops = RunOps(
            self.ctx,
            self.rollout,
            backend,
            make_sync=lambda b: make_weight_sync(cfg, b, on_event=self.ctx.events.record),
        )
        self.on_step = on_step
        base = Controller(self.ctx, self.ops, on_step=self._on_step, on_warmup=self._on_warmup)
        self.controller: Controller | AsyncController = AsyncController(base) if cfg.mode == "async" else base
        self.task: asyncio.Task[None] | None = None

    def _on_step(self, step: StepRecord) -> None:
        self.record.step(step)
        self.on_step(step)

    def _on_warmup(self, step: int, metrics: dict[str, float]) -> None:
        self.record.warmup_step(step, metrics)

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    async def run(self) -> None:
        state, error = RunState.FAILED, None
        try:
            state = await self.controller.run()
        except asyncio.CancelledError:
            error = "cancelled (the trainer service is shutting down)"
            raise
        except Exception as exc:
            log.exception("run %s failed", self.ctx.run_id)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                if state is RunState.FAILED:
                    await self.controller.save_after_fault()
                await self._clean_up()
                self.ctx.status.summary = await asyncio.to_thread(self.summary, state, error)
            except Exception:  # the run still ends: a poller must not wait on "running" forever
                log.exception("run %s: its end failed", self.ctx.run_id)
                state = RunState.FAILED
            self.ctx.end(state, error)
            log.info("run %s %s: %s", self.ctx.run_id, state.value, json.dumps(self.ctx.status.summary))

    async def _clean_up(self) -> None:
        for step in (self.ops.close, self.rollout.aclose):
            try:
                await step()
            except Exception as exc:
                log.warning("run %s: clean-up: %s: %s", self.ctx.run_id, type(exc).__name__, exc)
        self.record.close()

    def summary(self, state: RunState, error: str | None) -> dict[str, Any]:
        rows = self.record.rows()
        report = draw_report(rows, self.record.report_path, f"vime run {self.ctx.run_id}")
        return {
            "run_id": self.ctx.run_id,
            "state": state.value,
            "error": error,
            **summarize(rows),
            **warmup_summary(self.record.warmup_rows()),
            "next_rollout_id": self.ctx.status.next_rollout_id,
            "checkpoint": self.ctx.status.checkpoint,
            "metrics": str(self.record.metrics_path),
            "report": str(report) if report else None,
        }


class RunRegistry:
    """The runs this service knows; at most one active."""

    def __init__(self, load: ConfigLoader, backend_factory: BackendFactory) -> None:
        self.load = load
        self.backend_factory = backend_factory
        self.runs: dict[str, RunHandle] = {}
        self.active: RunHandle | None = None
        self.on_step: Callable[[StepRecord], None] = lambda step: None
        self._starting = False

    async def start(self, request: RunRequest) -> RunHandle:
        if self.active is not None and self.active.busy:
            status = self.active.ctx.status
            raise ServiceError(
                409, f"run {status.run_id} is {status.state.value}: one active run per trainer"
            )
        if self._starting:
            raise ServiceError(409, "another run is being started: one active run per trainer")
        self._starting = True
        try:
            cfg = run_config(self.load, request)
            first = first_rollout(cfg, request.resume)
            await check_mode(cfg)
            try:
                backend = await asyncio.to_thread(self.backend_factory, cfg)
            except (FileNotFoundError, ValueError) as exc:
                raise ServiceError(422, f"cannot build the trainer for this config: {exc}") from None
        finally:
            self._starting = False
        handle = RunHandle(cfg, backend, self.on_step, first)
        handle.task = asyncio.create_task(handle.run(), name=f"run-{handle.ctx.run_id}")
        self.runs[handle.ctx.run_id] = self.active = handle
        return handle

    def get(self, run_id: str) -> RunHandle:
        handle = self.runs.get(run_id)
        if handle is None:
            raise ServiceError(404, f"no run {run_id!r}")
        return handle

    def require_active(self) -> RunHandle:
        if self.active is None or self.active.ctx.status.state not in ACTIVE_STATES:
            raise ServiceError(409, "no active run: POST /v1/runs first")
        return self.active

    def cancel(self) -> None:
        """A signal: the active run stops where it is, at once (a rollout or its offload, where a
        checkpoint of the last step is safe, must not go on into the training after it). Once
        only: a second cancel would cut the clean-up the first one started (that checkpoint)."""
        task = self.active.task if self.active is not None else None
        if task is not None and not task.done() and not task.cancelling():
            task.cancel()

    async def aclose(self) -> None:
        """Service shutdown: cancel the active run and wait for its clean-up (which stops its ranks)."""
        if self.active is not None and self.active.task is not None:
            self.cancel()
            await asyncio.gather(self.active.task, return_exceptions=True)
