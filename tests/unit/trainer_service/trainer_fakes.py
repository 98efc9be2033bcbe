"""In-process stand-ins for the services and ranks the trainer's run loop drives, recording what
was asked of them (the engines and weight buckets are `engine_fakes`).

- `FakeRollout`: the rollout manager as `RolloutClient` methods, with its engine bookkeeping
  (asleep tags, weight versions, needs-weights, the update lock, admission).
- `FakeBackend`: the trainer ranks (start, train, SFT warm-up, sleep/wake, save/load) in memory;
  like the ranks it refuses to train, save or load while asleep, and it records the batches it
  was pointed at instead of reading them from Redis.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from engine_fakes import engine_info
from vime_trainer.batches import BatchRef, ShareSummary, TrainResult

from vime.wire.rollout import (
    AdmissionResult,
    EnginesStatus,
    JobState,
    MemoryResult,
    RolloutJob,
    SftBatch,
    TrainingCompleted,
    UpdatableEngines,
)

# --- rollout manager --------------------------------------------------------------------------


class FakeRollout:
    """The rollout manager's REST surface as the trainer's `RolloutClient` exposes it."""

    def __init__(self, urls: list[str], *, offloaded: bool = True, version: int = 0) -> None:
        tags = ["kv_cache", "weights"] if offloaded else []
        self.engines_ = [
            engine_info(u, i, weight_version=version, asleep=list(tags)) for i, u in enumerate(urls)
        ]
        self.version = version
        self.calls: list[tuple[str, Any]] = []
        self.admission_paused = False
        self.data = {"epoch": 0, "sample_group_index": 0}
        self.lease = itertools.count()
        self.eval_available = True
        self.keep_asleep: set[str] = set()
        """Engines whose weights stay asleep whatever is asked (a broken wake)."""
        self.fail_wake: set[str] = set()
        """Engines whose wake fails (dead behind their gate, the monitor not knowing yet)."""

    def _status(self) -> EnginesStatus:
        return EnginesStatus(
            engines=[e.model_copy() for e in self.engines_],
            weight_version=self.version,
            health_monitor_paused=False,
            update_lock_held=False,
        )

    async def engines(self) -> EnginesStatus:
        return self._status()

    async def rollout(
        self, rollout_id: int, *, evaluation: bool = False, dp_size: int | None = None
    ) -> RolloutJob:
        self.calls.append(("eval" if evaluation else "rollout", rollout_id))
        if evaluation and not self.eval_available:
            from vime.clients.base import ServiceCallError

            raise ServiceCallError("POST", "/v1/rollouts", 400, "no eval dataset configured")
        if self.admission_paused and not evaluation:  # admission gates training rollouts only
            raise AssertionError("rollout while admission is paused")
        if any(e.asleep for e in self.engines_ if e.url not in self.fail_wake):  # those are dead
            raise AssertionError("rollout while engines are offloaded")
        if evaluation:
            return RolloutJob(
                job_id=f"e{rollout_id}",
                rollout_id=rollout_id,
                evaluation=True,
                state=JobState.DONE,
                metrics={"eval/x/reward_mean": 0.5},
            )
        self.data["sample_group_index"] += 2
        return RolloutJob(
            job_id=f"j{rollout_id}",
            rollout_id=rollout_id,
            state=JobState.DONE,
            run_id="mgr",
            batch_id=f"mgr:{rollout_id}:0",
            num_samples=8,
            dp_size=dp_size,
            weight_version=self.version,
            metrics={
                "rollout/reward_mean": 0.25 * rollout_id,
                "rollout/reward_std": 0.1,
                "rollout/response_len_mean": 5.0,
            },
        )

    async def sft_batch(self, step: int, *, dp_size: int | None = None) -> SftBatch:
        self.calls.append(("sft", (step, dp_size)))
        return SftBatch(
            step=step,
            run_id="mgr:sft",
            batch_id=f"mgr:sft:{step}:0",
            num_samples=8,
            dp_size=dp_size or 1,
            metrics={"sft/label_len_mean": 3.0},
        )

    async def offload(self, level: int | None = None) -> MemoryResult:
        self.calls.append(("offload", level))
        for e in self.engines_:
            e.asleep = ["kv_cache", "weights"]
        return MemoryResult(action="offload", level=2, results={e.url: "ok" for e in self.engines_})

    async def onload(self, tags: list[str] | None = None) -> MemoryResult:
        self.calls.append(("onload", tags))
        sent = [t for t in (tags or ["weights", "kv_cache"]) if t in ("weights", "kv_cache")]
        results = {}
        for e in self.engines_:
            if e.url in self.fail_wake:
                results[e.url] = (
                    f"error: ServiceCallError: POST {e.url}/wake_up -> 502: the engine did not answer"
                )
                continue
            if e.url not in self.keep_asleep:
                e.asleep = [t for t in e.asleep if t not in sent]
            results[e.url] = "ok"
        return MemoryResult(action="onload", tags_sent=sent, results=results)

    async def update_lock(self, ttl_s: float = 600.0) -> UpdatableEngines:
        self.calls.append(("update_lock", None))
        live = [e.model_copy() for e in self.engines_ if e.status in ("ready", "needs_weights")]
        return UpdatableEngines(
            lease_id=f"L{next(self.lease)}",
            engines=live,
            num_new_engines=sum(e.needs_weights for e in live),
            weight_version=self.version,
        )

    async def release_update_lock(self, lease_id: str) -> None:
        self.calls.append(("release_update_lock", lease_id))

    async def weights_loaded(
        self, version: int, *, lease_id: str | None = None, engine_urls: list[str] | None = None
    ) -> EnginesStatus:
        self.calls.append(("weights_loaded", (version, tuple(engine_urls or ()))))
        if version < self.version:
            raise AssertionError(f"version {version} older than {self.version}")
        self.version = version
        for e in self.engines_:
            if engine_urls is None or e.url in engine_urls:
                e.weight_version, e.needs_weights, e.status = version, False, "ready"
        return self._status()

    async def pause_admission(self) -> AdmissionResult:
        self.calls.append(("pause_admission", None))
        was_paused, self.admission_paused = self.admission_paused, True
        return AdmissionResult(was_paused=was_paused, paused=True)

    async def resume_admission(self, was_paused: bool) -> AdmissionResult:
        self.calls.append(("resume_admission", was_paused))
        if not was_paused:
            self.admission_paused = False
        return AdmissionResult(was_paused=was_paused, paused=self.admission_paused)

    async def training_ready(self) -> dict[str, Any]:
        self.calls.append(("training_ready", None))
        self.admission_paused = False  # what a previous run's last step left paused opens again
        return {"training_ready": True, "admission_paused": False}

    async def training_completed(self, rollout_id: int) -> TrainingCompleted:
        self.calls.append(("training_completed", rollout_id))
        return TrainingCompleted(rollout_id=rollout_id, pending_batches=0)

    async def data_state(self) -> dict[str, Any]:
        return dict(self.data)

    async def set_data_state(self, state: dict[str, Any]) -> None:
        self.calls.append(("set_data_state", state))
        self.data = dict(state)


# --- trainer ------------------------------------------------------------------------------------


class FakeBackend:
    """The trainer ranks in memory: checkpoints are kept in a dict, like `ActorGroup`'s files."""

    def __init__(self, dp_size: int = 1, checkpoints: dict[int, dict[str, Any]] | None = None) -> None:
        self.dp_size = dp_size
        self.calls: list[str] = []
        self.asleep = False
        self.checkpoints = checkpoints if checkpoints is not None else {}
        self.writing: tuple[int, dict[str, Any]] | None = None
        """A save that did not wait, not yet complete."""
        self.on_train: Callable[[int], None] | None = None
        self.on_train_sft: Callable[[int], None] | None = None
        self.refs: list[BatchRef] = []
        """Every batch the ranks were told to read, in order."""
        self.version: Callable[[], int] = lambda: 0
        """The weight version the engines hold (the one a batch's samples carry)."""
        self.skipped: list[tuple[str, int]] = []
        """What the ranks report skipping on their next read (then nothing)."""
        self.memory_s = 0.0
        self.sleep_memory: dict[str, float] = {}
        """How long each sleep and wake-up takes (the ranks' copies to and from pinned memory)."""

    def start(self) -> None:
        self.calls.append("start")

    def _result(self, ref: BatchRef, steps: list[dict[str, float]]) -> TrainResult:
        self.refs.append(ref)
        shares = [ShareSummary(d, 4, 1, (self.version(),)) for d in range(self.dp_size)]
        skipped, self.skipped = self.skipped, []
        return TrainResult(steps, shares, skipped)

    def _awake(self, what: str) -> None:
        if self.asleep:
            raise AssertionError(f"{what} while the trainer is asleep: the loop must wake it first")

    def train(self, ref: BatchRef) -> TrainResult:
        self.calls.append(f"train {ref.rollout_id}")
        self._awake("train")
        if self.on_train is not None:
            self.on_train(ref.rollout_id)
        return self._result(ref, [{"loss": 0.5, "grad_norm": 1.0}])

    def train_sft(self, ref: BatchRef) -> TrainResult:
        self.calls.append(f"train_sft {ref.rollout_id}")
        self._awake("train_sft")
        if self.on_train_sft is not None:
            self.on_train_sft(ref.rollout_id)
        return self._result(ref, [{"loss": 3.0 / (1 + ref.rollout_id), "grad_norm": 1.0}])

    def sleep(self, offload: bool = True, keep_weights: bool = False) -> dict[str, float]:
        self.calls.append(
            ("sleep" if offload else "sleep without offload") + (" keeping weights" if keep_weights else "")
        )
        time.sleep(self.memory_s)
        self.asleep = True
        return dict(self.sleep_memory)

    def drop_weights(self) -> dict[str, float]:
        self.calls.append("drop_weights")
        return {"freed_gib": 0.5}

    def wake_up(self) -> None:
        self.calls.append("wake_up")
        time.sleep(self.memory_s)
        self.asleep = False

    def save(self, rollout_id: int, run_state: dict[str, Any], wait: bool = True) -> str:
        self.calls.append(f"save {rollout_id}" + ("" if wait else " in the background"))
        self._awake("save")
        self._complete()
        self.writing = (
            rollout_id,
            {"rollout_id": rollout_id, "next_rollout_id": rollout_id + 1, "run_state": run_state},
        )
        if wait:
            self._complete()
        return f"ckpt/rollout_{rollout_id:07d}"

    def saved(self) -> str | None:
        if self.writing is not None:
            self.calls.append(f"saved {self.writing[0]}")
        return self._complete()

    def _complete(self) -> str | None:
        if self.writing is None:
            return None
        rollout_id, state = self.writing
        self.writing = None
        self.checkpoints[rollout_id] = state
        return f"ckpt/rollout_{rollout_id:07d}"

    def load(self, path: str | None = None) -> dict[str, Any] | None:
        self.calls.append("load")
        self._awake("load")
        if not self.checkpoints:
            return None
        return self.checkpoints[max(self.checkpoints)]

    def shutdown(self) -> None:
        self.calls.append("shutdown")
