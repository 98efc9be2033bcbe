"""Trainer service wire schemas: runs (the seed's driver loop, steps 1–55), their per-step timings
and metrics, manual weight pushes (45–52) and checkpoints.

``T_step = T_rollout + T_offload + T_train + T_onload_weights + T_weight_sync + T_onload_kv``
(seed §1): `StepTimings` carries each part and their sum. Requests forbid unknown fields, so a
typo is a 422 naming it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

STEP_PHASES = ("rollout", "offload", "train", "onload_weights", "weight_sync", "onload_kv")
"""The parts of T_step, in the order a step runs them (seed: 14–32, 33–36, 37–42, 43, 44–53, 54)."""


RUN_ID_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$"
"""A run id names directories (runs/<id>, <checkpoint_dir>/<id>): no separators, no leading dot."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunState(StrEnum):
    RUNNING = "running"
    STOPPING = "stopping"
    """A stop was asked: the current step finishes, a checkpoint is written, then the run ends."""
    FINISHED = "finished"
    """All ``num_rollout`` rollouts done."""
    STOPPED = "stopped"
    FAILED = "failed"


ACTIVE_STATES = (RunState.RUNNING, RunState.STOPPING)


class RunPhase(StrEnum):
    """Where the driver loop is (seed §1's timeline)."""

    STARTING = "starting"
    WARMUP = "warmup"
    """Supervised warm-up steps on the labels (``trainer.sft_warmup_steps``), before the first push."""
    ROLLOUT = "rollout"
    OFFLOAD = "offload"
    TRAIN = "train"
    SAVE = "save"
    ONLOAD_WEIGHTS = "onload_weights"
    WEIGHT_SYNC = "weight_sync"
    ONLOAD_KV = "onload_kv"
    EVAL = "eval"
    DONE = "done"


class StepTimings(BaseModel):
    """Seconds spent in each phase of one step; ``step_s`` is their sum (T_step)."""

    rollout_s: float = 0.0
    offload_s: float = 0.0
    train_s: float = 0.0
    onload_weights_s: float = 0.0
    weight_sync_s: float = 0.0
    onload_kv_s: float = 0.0
    step_s: float = 0.0
    save_s: float = 0.0
    """Checkpoint time of this step (not part of T_step)."""
    eval_s: float = 0.0
    """Evaluation time after this step (not part of T_step)."""

    @classmethod
    def from_phases(cls, seconds: dict[str, float]) -> StepTimings:
        parts = {f"{p}_s": float(seconds.get(p, 0.0)) for p in STEP_PHASES}
        extra = {f"{p}_s": float(seconds.get(p, 0.0)) for p in ("save", "eval")}
        return cls(**parts, **extra, step_s=sum(parts.values()))


class StepRecord(BaseModel):
    """One finished step: its rollout, the weights it generated with and produced, timings, metrics."""

    rollout_id: int
    weight_version: int
    """Version pushed at the end of this step (the next rollout generates with it)."""
    timings: StepTimings
    metrics: dict[str, float] = Field(default_factory=dict)
    finished_at: float = 0.0


class RunRequest(_Request):
    """``POST /v1/runs``: start a run; ``config`` overrides the service's run config (nested keys)."""

    run_id: str | None = Field(None, min_length=1, max_length=128, pattern=RUN_ID_PATTERN)
    """Names runs/<run_id>/ and the checkpoints; None: the config's run_id or $VIME_RUN_ID
    (`RunConfig.effective_run_id`), else a timestamp."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Run config fields on top of the service's config, e.g. ``{"num_rollout": 3, "trainer": {"lr": 1e-4}}``."""
    resume: bool = False
    """Continue run ``run_id`` after its newest checkpoint (409 when it has none; ``start_rollout_id``
    may not be given). Without it a run id that has checkpoints also continues after the newest."""


class RunStatus(BaseModel):
    """``GET /v1/runs/{run_id}``."""

    run_id: str
    state: RunState
    phase: RunPhase
    rollout_id: int | None = None
    """The rollout the loop is on (None before the first)."""
    start_rollout_id: int | None = None
    """Where this run (re)started: 0, or the checkpoint's next rollout id when resuming."""
    next_rollout_id: int | None = None
    """The rollout a resumed run would start at (after the last finished step)."""
    num_rollout: int
    weight_version: int = 0
    """Version of the weights the engines hold (pushed by this run)."""
    mode: str = "sync"
    """The run's loop: ``sync`` (the seed's) or ``async``."""
    last_batch_staleness: int | None = None
    """async: the trainer's weight version minus the oldest version that sampled the last batch it
    took (at most ``max_staleness``)."""
    dropped_batches: int = 0
    """async: batches dropped untrained so far (staler than the bound, or left from before the run)."""
    steps_done: int = 0
    last_step: StepRecord | None = None
    checkpoint: str | None = None
    """The newest checkpoint this run wrote or resumed from."""
    stop_requested: bool = False
    error: str | None = None
    started_at: float = 0.0
    finished_at: float | None = None
    summary: dict[str, Any] | None = None
    """Set when the run ends (also printed by the CLI)."""


class RunList(BaseModel):
    runs: list[RunStatus]
    active: str | None = None


class RunEvent(BaseModel):
    """One action of the driver loop, in order (engine memory, trainer memory, weight-sync phases)."""

    seq: int
    t: float
    """Seconds since the run started."""
    rollout_id: int | None
    action: str
    """e.g. ``engines.offload``, ``trainer.sleep``, ``engines.onload``, ``weights.update``."""
    detail: dict[str, Any] = Field(default_factory=dict)


class RunEvents(BaseModel):
    run_id: str
    events: list[RunEvent]


class PushRequest(_Request):
    """``POST /v1/weights/push``: push the active run's weights (version + 1) at the next step boundary."""

    wait: bool = True
    """Block until the push is done (else 202 at once)."""


class PushResult(BaseModel):
    """What a weight push did (seed steps 45–52)."""

    version: int
    flushed: bool
    """Whether in-flight requests were aborted and the prefix cache reset (should_flush_cache)."""
    transport: str
    engines: list[str]
    buckets: int
    bytes: int
    seconds: float
    """Pause → resume."""
    weight_load: str = "vllm"
    """How the engines loaded it: ``vllm`` (its weight loaders) or ``direct`` (engine.weight_load)."""
    phases: dict[str, float] = Field(default_factory=dict)
    """Seconds of each part: pause, flush, init, start, update, finish or label, resume."""


class CheckpointRequest(_Request):
    """``POST /v1/checkpoints``: checkpoint the active run after its current step's training."""

    wait: bool = True


class CheckpointResult(BaseModel):
    rollout_id: int
    next_rollout_id: int
    path: str
    weight_version: int
    seconds: float


class Accepted(BaseModel):
    """A request taken up by the run loop, answered before it is done (``wait=false``)."""

    run_id: str
    accepted: str
