"""Rollout manager wire schemas: rollouts (seed steps 14–32), supervised warm-up batches, engine
memory (4–13, 33–36), weight bookkeeping (the seed's ``get_updatable_engines_and_lock``, 45–51),
admission (44, 53), data-source state for checkpoints.

Requests forbid unknown fields, so a typo is a 422 naming it rather than a silently ignored option.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vime.wire.bounds import MAX_COUNT, MAX_ID, MAX_VERSION

MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]
"""The seed's GPU memory types; only ``weights`` and ``kv_cache`` reach vLLM (steps 10–13)."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutRequest(_Request):
    """``POST /v1/rollouts``: generate rollout ``rollout_id`` (or evaluate at it)."""

    rollout_id: int = Field(ge=0, le=MAX_ID)
    """The rollout (outer step) number; it names the batch, it does not size it (seed step 14)."""
    evaluation: bool = False
    """Run the eval datasets instead (metrics only, nothing published)."""
    wait: bool = True
    """Block until done; false returns the job at once (202) to poll with GET /v1/rollouts/{job_id}."""
    dp_size: int | None = Field(None, ge=1, le=MAX_COUNT)
    """The trainer's data-parallel size for the DP schedule; None uses the run config's."""
    publish: bool = True
    """False: a one-off look (``vime rollout``): the samples come back in the job, nothing goes to
    Redis and the data source's position is restored, so no run ever trains on it; never answered
    with (nor answering for) a training rollout's job. Ignored for evaluation (never published)."""


class RolloutSample(BaseModel):
    """One sample of an unpublished rollout, as ``vime rollout`` shows it."""

    group_index: int | None
    index: int | None
    prompt: str | list[dict[str, Any]]
    """The prompt as the dataset holds it (text, or chat messages)."""
    response: str
    prompt_ids: list[int]
    response_ids: list[int]
    reward: float | None
    advantage: float
    """The GRPO-normalised reward it would have trained with (seed step 30)."""
    status: str
    weight_version: str | None = None


class SftBatchRequest(_Request):
    """``POST /v1/sft-batches``: publish supervised warm-up step ``step`` (prompts + their labels)."""

    step: int = Field(ge=0, le=MAX_ID)
    """The warm-up step; it picks the prompts (the same step gives the same examples)."""
    dp_size: int | None = Field(None, ge=1, le=MAX_COUNT)
    """The trainer's data-parallel size for the DP split; None uses the run config's."""


class SftBatch(BaseModel):
    """A published warm-up batch: ``global_batch_size`` prompts, each with its label as the response."""

    step: int
    run_id: str
    """The run id it is published under (the manager's + ``:sft``): read it from that stream."""
    batch_id: str
    entry_id: str | None = None
    """Redis stream entry (None when this batch id had been published already)."""
    num_samples: int
    dp_size: int
    metrics: dict[str, float] = Field(default_factory=dict)


class JobState(StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class RolloutJob(BaseModel):
    """A rollout (or eval) job and, once done, what it produced."""

    job_id: str
    rollout_id: int
    evaluation: bool = False
    state: JobState = JobState.RUNNING
    run_id: str | None = None
    """The rollout manager's run id: its batches are on that run's Redis stream
    (`vime.queue.stream_key`), which is where a trainer reads ``batch_id`` from."""
    batch_id: str | None = None
    """Id of the batch published to Redis (training rollouts)."""
    entry_id: str | None = None
    """Redis stream entry of the batch."""
    num_samples: int = 0
    dp_size: int | None = None
    weight_version: int | None = None
    """Weight version the engines held when the rollout started."""
    metrics: dict[str, float] = Field(default_factory=dict)
    error: str | None = None
    created_at: float = 0.0
    finished_at: float | None = None
    preview: bool = False
    """An unpublished training rollout (``RolloutRequest.publish`` false): its samples are in ``samples``."""
    samples: list[RolloutSample] | None = None
    """The samples of a preview, groups in order; None for every other job."""


class EngineState(StrEnum):
    """Where an engine is in the rollout manager's lifecycle (the manager is its only judge)."""

    STARTING = "starting"
    READY = "ready"
    """Holds the current weights and is registered with the router."""
    NEEDS_WEIGHTS = "needs_weights"
    """Restarted after weights were pushed: answers, out of the router until the next push."""
    DEAD = "dead"
    RESTARTING = "restarting"
    STOPPED = "stopped"


LIVE = frozenset({EngineState.READY, EngineState.NEEDS_WEIGHTS})
"""Engines that answer: they receive memory calls and weight pushes."""


class EngineInfo(BaseModel):
    """One engine as the rollout manager sees it."""

    index: int
    url: str
    backend: str
    status: EngineState
    registered: bool
    """Whether the router sends it requests."""
    gpu_ids: list[int] = Field(default_factory=list)
    pid: int | None = None
    """Process id of a locally launched engine (None for containers and external engines)."""
    weight_version: int | None = None
    """Version of the weights it holds by the manager's bookkeeping (0: the checkpoint)."""
    reported_weight_version: str | None = None
    """What the engine itself reports (vLLM >= 0.33, reference engine); None where it reports nothing."""
    needs_weights: bool = False
    asleep: list[str] = Field(default_factory=list)
    restarts: int = 0
    last_error: str | None = None


class EnginesStatus(BaseModel):
    """``GET /v1/engines``."""

    engines: list[EngineInfo]
    weight_version: int
    """The version the trainer last reported loaded."""
    health_monitor_paused: bool
    update_lock_held: bool
    mode: Literal["sync", "async"] = "sync"
    """The loop the rollout manager was started for (its config's ``mode``)."""


OFFLOAD_LEVEL = 2
"""The engines' sleep while the trainer trains (seed step 34): level 2 drops weights and KV cache;
the push refills the weights."""


class OffloadRequest(_Request):
    """``POST /v1/engines/offload``; level None: `OFFLOAD_LEVEL`."""

    level: int | None = Field(None, ge=1, le=2)


class OnloadRequest(_Request):
    """``POST /v1/engines/onload``; tags None wakes everything."""

    tags: list[MemoryTag] | None = None


class MemoryResult(BaseModel):
    """Outcome of an offload/onload fanned out to every live engine (url -> ok | error: ...)."""

    action: Literal["offload", "onload"]
    level: int | None = None
    tags_sent: list[str] | None = None
    """The tags that reached vLLM after normalisation (None: all)."""
    results: dict[str, str]
    seconds: float = 0.0


class ResumeAdmissionRequest(_Request):
    was_paused: bool
    """What pause returned (seed step 53): True, admission was paused before step 44 and stays
    paused; False, step 44's pause is undone."""


class AdmissionResult(BaseModel):
    was_paused: bool
    """Pause: whether admission was already paused before this call (seed step 44); resume: as sent."""
    paused: bool
    """Whether admission is paused now."""


class UpdateLockRequest(_Request):
    ttl_s: float = Field(600.0, gt=0, le=3600)
    """The lease expires after this, so a trainer that dies while pushing does not block forever."""
    lease_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{8,64}$")
    """The caller's name for the lease: asking again with the lease it holds renews it (a request
    repeated after a lost reply) instead of answering 409. None: the manager names it."""


class UpdatableEngines(BaseModel):
    """``POST /v1/engines/update-lock``: the engines a push must reach, under a lease."""

    lease_id: str
    engines: list[EngineInfo]
    num_new_engines: int
    """Engines waiting for weights (restarted since the last push)."""
    weight_version: int


class WeightsLoadedRequest(_Request):
    """``POST /v1/engines/weights-loaded``: the trainer pushed ``version`` to these engines."""

    version: int = Field(ge=0, le=MAX_VERSION)
    """Never lower than the version the engines hold (409)."""
    lease_id: str | None = None
    """The update lock's lease, released by this call."""
    engine_urls: list[str] | None = None
    """None: every live engine."""


class TrainingCompleted(BaseModel):
    rollout_id: int
    pending_batches: int
    """Batches published but not yet acked by the slowest trainer rank."""


class DataSourceState(BaseModel):
    """``GET|PUT /v1/data-source/state``: the data source's position, saved with checkpoints."""

    model_config = ConfigDict(extra="forbid")

    state: dict[str, Any]


PRODUCER_NEXT_KEY = "producer_next_rollout_id"
"""In the data-source state handed out while the async producer has started: its next rollout id,
taken with the position (the batches below it were published from before that position)."""


class ProducerRequest(_Request):
    """``POST /v1/producer/start``: the async mode's rollouts ``[first_rollout_id, end_rollout_id)``."""

    first_rollout_id: int = Field(ge=0, le=MAX_ID)
    end_rollout_id: int = Field(ge=0, le=MAX_ID)
    """One past the last rollout (the run's ``num_rollout``)."""
    dp_size: int = Field(ge=1, le=MAX_COUNT)
    """The trainer's data-parallel size for the DP schedule."""
    max_staleness: int = Field(ge=1, le=MAX_COUNT)
    """A rollout starts only while fewer batches than this wait untaken."""


class ProducerStatus(BaseModel):
    """``GET /v1/producer``: the async mode's producer."""

    running: bool
    run_id: str
    """The rollout manager's run id: the batches are on its stream (`vime.queue.stream_key`)."""
    next_rollout_id: int | None = None
    """The rollout it produces next (None: never started)."""
    end_rollout_id: int | None = None
    max_staleness: int = 1
    published: int = 0
    """Batches published since it started."""
    waiting: int = 0
    """Batches published and not yet taken (nor dropped) by the trainer."""
    generating: bool = False
    """A rollout is under way."""
    generating_s: float = 0.0
    """Seconds rollouts have been under way, cumulated (the trainer diffs two reads)."""
    error: str | None = None
    """Why it stopped, when a rollout failed."""
