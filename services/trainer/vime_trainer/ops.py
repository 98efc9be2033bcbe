"""The seed's actions, one method each: a call to the rollout manager, the trainer ranks or the
engines, logged in the run's event log. `Controller` strings them together in the seed's order.

The trainer backend (`ActorGroup`) is blocking (Ray), so its calls run in worker threads and the
REST app stays responsive during a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from vime.clients.base import ServiceCallError
from vime.clients.rollout import RolloutClient
from vime.retry import poll_until
from vime.wire.engine import PauseMode
from vime.wire.rollout import LIVE, EngineInfo, EnginesStatus, MemoryResult, RolloutJob
from vime.wire.trainer import CheckpointResult, PushResult
from vime_trainer.batches import BatchRef, ShareSummary, TrainResult, log_skipped
from vime_trainer.state import RunContext
from vime_trainer.weight_sync import WeightSync

log = logging.getLogger("vime.trainer.run")


class RunError(RuntimeError):
    """The run cannot go on; the message says why."""


class RunStopped(Exception):
    """A stop was asked before the run got anywhere (e.g. while waiting for the rollout manager)."""


class Backend(Protocol):
    """What the loop uses of the training ranks (`vime_trainer.megatron.actor_group.ActorGroup`)."""

    @property
    def dp_size(self) -> int: ...
    def start(self) -> None: ...
    def train(self, ref: BatchRef) -> TrainResult: ...
    def train_sft(self, ref: BatchRef) -> TrainResult: ...
    def sleep(self, offload: bool = True, keep_weights: bool = False) -> dict[str, float]: ...
    def drop_weights(self) -> dict[str, float]: ...
    def wake_up(self) -> None: ...
    def save(self, rollout_id: int, run_state: dict[str, Any], wait: bool = True) -> str: ...
    def saved(self) -> str | None: ...
    def load(self, path: str | None = None) -> dict[str, Any] | None: ...
    def shutdown(self) -> None: ...


class RunOps:
    """Everything the driver loop does, with the weight version the engines hold."""

    def __init__(
        self,
        ctx: RunContext,
        rollout: RolloutClient,
        backend: Backend,
        make_sync: Callable[[Backend], WeightSync],
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.rollout = rollout
        self.backend = backend
        self.make_sync = make_sync
        self.redis_url = self.cfg.services.redis_url or ""
        """Where the rollout manager publishes the batches the ranks read."""
        self.events = ctx.events
        self.version = 0
        """Version of the weights the engines hold."""
        self.start_version = 0
        """What the engines held when this run (re)started (`should_flush_cache`)."""
        self.sync: WeightSync | None = None
        self.push_metrics: dict[str, float] = {}
        """The last push's pause → resume seconds and each of its phases (``weights/<phase>_s``)."""
        self.trainer_memory_metrics: dict[str, float] = {}
        """Seconds of the last trainer wake-up and sleep (``trainer/wake_s``, ``trainer/sleep_s``):
        the parts of T_train that move the training state between the GPU and pinned memory."""
        self.save_started = 0.0
        """When the newest save began (`time.perf_counter`)."""

    # --- start-up (seed steps 2, 3, 9) -----------------------------------------------------
    async def wait_rollout_manager(self, timeout_s: float = 900.0) -> EnginesStatus:
        """Step 2 happens in the rollout manager's start-up: wait until it serves, engines started."""
        last = "no answer yet"

        async def ready() -> EnginesStatus | None:
            nonlocal last
            if self.ctx.stop_requested:
                raise RunStopped()
            try:
                status = await self.rollout.engines()
            except Exception as exc:
                last = f"{type(exc).__name__}: {exc}"
                return None
            if status.mode != self.cfg.mode:
                raise RunError(
                    f"mode={self.cfg.mode}, but the rollout manager was started with mode={status.mode}"
                )
            if not any(e.status in LIVE for e in status.engines):
                last = "no live engine yet"
                return None
            self.events.record("rollout.ready", engines=len(status.engines), version=status.weight_version)
            return status

        try:
            return await poll_until(ready, timeout_s=timeout_s, interval_s=1.0, what="the rollout manager")
        except TimeoutError:
            raise RunError(f"the rollout manager is not ready after {timeout_s:.0f}s: {last}") from None

    async def start_trainer(self, resume: bool) -> dict[str, Any] | None:
        """Step 3: start the ranks (HF weights); when resuming, load the newest checkpoint over them."""
        await asyncio.to_thread(self.backend.start)
        dp = self.backend.dp_size
        self.events.record("trainer.start", dp_size=dp, world_size=self.cfg.train_world_size)
        self.sync = self.make_sync(self.backend)
        if not resume:
            return None
        state = await asyncio.to_thread(self.backend.load, None)
        self.events.record("trainer.load", found=state is not None)
        return state

    async def training_ready(self) -> None:
        """Step 9: the weights are on the engines (the rollout manager opens admission a previous
        run's last step left paused)."""
        await self.rollout.training_ready()
        self.events.record("rollout.training_ready")

    # --- memory (seed steps 4–7, 10–13, 33–36, 37, 41, 43, 54) -------------------------------
    async def onload_weights(self) -> None:
        """Steps 4–7 and 43: the engines' weight memory comes back (its content is pushed next)."""
        await self._onload(["weights"])

    async def onload_kv(self) -> None:
        """Steps 10–13 and 54: the engines' KV cache comes back, empty."""
        await self._onload(["kv_cache", "cuda_graph"])

    async def _onload(self, tags: list[str]) -> None:
        if not self.cfg.offload_rollout:
            return
        result = await self.rollout.onload(tags)
        self._memory_event(result, tags=result.tags_sent)

    async def offload(self) -> None:
        """Steps 33–36: the engines sleep (level 2: weights and KV cache dropped)."""
        if not self.cfg.offload_rollout:
            return
        result = await self.rollout.offload()
        self._memory_event(result, level=result.level)

    def _memory_event(self, result: MemoryResult, **detail: Any) -> None:
        failed = {u: r for u, r in result.results.items() if r.startswith("error")}
        self.events.record(
            f"engines.{result.action}", engines=len(result.results), failed=len(failed), **detail
        )
        for url, res in failed.items():
            log.warning("%s on %s: %s", result.action, url, res)

    @property
    def trainer_sleeps(self) -> bool:
        """The trainer frees GPU memory for the engines: offloaded (``offload_train``), or, in the
        synchronous colocated step without it, only what needs no copy (the seed's ``clear_memory``;
        the optimizer state stays on the GPU)."""
        return bool(self.cfg.offload_train) or (self.cfg.colocate and self.cfg.mode == "sync")

    async def trainer_wake_up(self) -> None:
        """Step 37: the trainer takes its GPU memory back (the engines sleep)."""
        if self.trainer_sleeps:
            t0 = time.perf_counter()
            await asyncio.to_thread(self.backend.wake_up)
            self.trainer_memory_metrics["trainer/wake_s"] = time.perf_counter() - t0
            self.events.record("trainer.wake_up")

    async def trainer_sleep(self, keep_weights: bool = False) -> None:
        """Step 41: free the trainer's GPU memory before the engines wake; ``keep_weights``: all but
        its weights, which the push that follows reads there (a device copy, not one up from the
        CPU backup) until `trainer_drop_weights`."""
        if self.trainer_sleeps:
            t0 = time.perf_counter()
            memory = await asyncio.to_thread(self.backend.sleep, bool(self.cfg.offload_train), keep_weights)
            self.trainer_memory_metrics["trainer/sleep_s"] = time.perf_counter() - t0
            self.trainer_memory_metrics |= {f"trainer/{k}": v for k, v in memory.items()}
            self.events.record("trainer.sleep", offload=bool(self.cfg.offload_train))

    async def trainer_drop_weights(self) -> None:
        """End of step 41: the weights the push read leave the GPU before the KV cache comes back."""
        if self.trainer_sleeps:
            t0 = time.perf_counter()
            memory = await asyncio.to_thread(self.backend.drop_weights)
            m = self.trainer_memory_metrics
            m["trainer/drop_weights_s"] = time.perf_counter() - t0
            m["trainer/freed_gib"] = m.get("trainer/freed_gib", 0.0) + memory.pop("freed_gib", 0.0)
            m |= {f"trainer/{k}": v for k, v in memory.items()}
            self.events.record("trainer.drop_weights")

    # --- rollout and training (seed steps 14–32, 37–42) ----------------------------------------
    async def generate(self, rollout_id: int) -> RolloutJob:
        """Steps 14–32: one rollout, published to Redis split per DP rank. An engine restarted
        meanwhile gets the current weights while the rollout waits for it (`catching_up`)."""
        self.events.record("rollout.start")
        async with self.catching_up():
            job = await self.rollout.rollout(rollout_id, dp_size=self.backend.dp_size)
        if not job.batch_id or not job.run_id:
            raise RunError(f"rollout {rollout_id} returned no batch: {job.error or 'unknown reason'}")
        self.events.record("rollout.done", batch_id=job.batch_id, samples=job.num_samples)
        return job

    async def train(self, rollout_id: int, job: RolloutJob) -> dict[str, float]:
        """Steps 37–40 on the awake trainer: the ranks read their shares of the rollout's batch
        from Redis, train on them and ack them."""
        self.events.record("trainer.train", batch_id=job.batch_id)
        ref = BatchRef(self.redis_url, job.run_id or "", job.batch_id or "", rollout_id)
        result = await asyncio.to_thread(self.backend.train, ref)
        self._skipped(result, ref)
        return {**train_metrics(result.steps), **batch_metrics(result.shares)}

    async def training_completed(self, rollout_id: int) -> None:
        """Step 42: the rollout manager's batch of this rollout is consumed."""
        done = await self.rollout.training_completed(rollout_id)
        self.events.record("rollout.training_completed", pending_batches=done.pending_batches)

    async def sft_step(self, step: int, steps: int) -> dict[str, float]:
        """One supervised warm-up step: the rollout manager publishes prompts with their labels as
        responses (its data source has them), the ranks take the cross-entropy of the labels."""
        t0 = time.perf_counter()
        reply = await self.rollout.sft_batch(step, dp_size=self.backend.dp_size)
        ref = BatchRef(self.redis_url, reply.run_id, reply.batch_id, step)
        result = await asyncio.to_thread(self.backend.train_sft, ref)
        self._skipped(result, ref)
        metrics = train_metrics(result.steps, prefix="sft")
        seconds = time.perf_counter() - t0
        loss = metrics.get("sft/loss", float("nan"))
        self.events.record("sft.step", step=step, steps=steps, loss=round(loss, 5), seconds=round(seconds, 3))
        return {**metrics, **reply.metrics, "sft/seconds": seconds}

    def _skipped(self, result: TrainResult, ref: BatchRef) -> None:
        if result.skipped:
            log_skipped(result.skipped, ref)
            self.events.record("trainer.skipped", batches=[b for b, _ in result.skipped])

    # --- weight sync (seed steps 44–53) -------------------------------------------------------
    async def pause_rollout_admission(self) -> bool:
        """Step 44: no training rollout starts while weights change; returns ``was_paused``."""
        result = await self.rollout.pause_admission()
        self.events.record("admission.pause", was_paused=result.was_paused)
        return result.was_paused

    async def resume_rollout_admission(self, was_paused: bool) -> None:
        """Step 53: undo step 44's pause (a no-op when it found admission paused already)."""
        result = await self.rollout.resume_admission(was_paused)
        self.events.record("admission.resume", was_paused=was_paused, paused=result.paused)

    async def update_weights(
        self, version: int, flush: bool, *, stale_only: bool = False, mode: PauseMode | None = None
    ) -> PushResult | None:
        """Steps 45–52 to the engines of the update lock (only the stale ones with ``stale_only``),
        pausing them with ``mode`` (None: step 46's, ``abort`` when flushing, else ``keep``)."""
        assert self.sync is not None, "start_trainer first"
        lease = await self.rollout.update_lock()
        done = False
        try:
            targets = [e for e in lease.engines if not stale_only or self._stale(e)]
            if not targets:
                return None
            self.events.record("weights.push", version=version, flush=flush, engines=[e.url for e in targets])
            targets = await self._weights_awake(targets)
            report = await self.sync.push(targets, version, flush, mode)
            await self.rollout.weights_loaded(version, lease_id=lease.lease_id, engine_urls=report.engines)
            done = True
        finally:
            if not done:
                with contextlib.suppress(Exception):
                    await self.rollout.release_update_lock(lease.lease_id)
        self.version = self.ctx.status.weight_version = version
        phases = {k: round(v, 4) for k, v in report.phases.items()}
        self.events.record(
            "weights.loaded",
            version=version,
            engines=report.engines,
            catch_up=stale_only,
            buckets=report.buckets,
            nbytes=report.nbytes,
            weight_load=report.weight_load,
            seconds=round(report.seconds, 4),
            phases=phases,
            update_parts={k: round(v, 4) for k, v in report.update_parts.items()},
        )
        self.push_metrics = (
            {"weights/push_s": report.seconds}
            | {f"weights/{k}_s": v for k, v in phases.items()}
            | {f"weights/update_{k}": v for k, v in report.update_parts.items()}
        )
        return PushResult(
            version=version,
            flushed=flush,
            transport=self.sync.transport.name,
            engines=report.engines,
            buckets=report.buckets,
            bytes=report.nbytes,
            seconds=report.seconds,
            weight_load=report.weight_load,
            phases=phases,
        )

    def _stale(self, engine: EngineInfo) -> bool:
        return engine.needs_weights or engine.weight_version != self.version

    async def push_catch_up(self) -> PushResult | None:
        """Engines restarted (or missed a push) get the current weights before they serve again."""
        status = await self.rollout.engines()
        if not any(e.status in LIVE and self._stale(e) for e in status.engines):
            return None
        return await self.update_weights(self.version, True, stale_only=True)

    @contextlib.asynccontextmanager
    async def catching_up(self) -> AsyncIterator[None]:
        """`push_catch_up` every ``engine.health_check_interval_s`` (the monitor's pace) while the
        block runs: an engine that died inside a rollout comes back needing weights, out of the
        router, and the rollout's generates wait for it (``router.retry_window_s``); with one
        engine nothing else would ever serve them. The push reads the trainer's CPU copy of its
        weights, so it needs the trainer neither awake nor idle. A failed round is logged and
        tried again; a push under way when the block ends is finished, not cut."""
        done = asyncio.Event()

        async def pusher() -> None:
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), self.cfg.engine.health_check_interval_s)
                    return
                try:
                    pushed = await self.push_catch_up()
                except Exception as exc:
                    log.warning("catching up a restarted engine: %s: %s", type(exc).__name__, exc)
                else:
                    if pushed is not None and pushed.engines:  # none: gone at the pause, not yet seen dead
                        log.info(
                            "engine(s) %s caught up to v%d during the rollout", pushed.engines, pushed.version
                        )

        task = asyncio.create_task(pusher(), name="catch-up")
        try:
            yield
        except BaseException:
            task.cancel()  # the run fails or is cancelled: no push to wait for
            raise
        finally:
            done.set()
            await asyncio.gather(task, return_exceptions=True)

    async def _weights_awake(self, targets: list[EngineInfo]) -> list[EngineInfo]:
        """Never push into sleeping weights (vLLM has no guard): wake them, or refuse. An engine
        whose wake failed (it died while asleep, before the monitor saw it) is left out of the push:
        the rollout manager keeps it out of the router until a push brings it the version."""
        if not any("weights" in e.asleep for e in targets):
            return targets
        result = await self.rollout.onload(["weights"])
        self._memory_event(result, tags=result.tags_sent, reason="push guard")
        now = {e.url: e for e in (await self.rollout.engines()).engines}
        asleep = [e.url for e in targets if "weights" in now.get(e.url, e).asleep]
        failed = [u for u in asleep if result.results.get(u, "").startswith("error")]
        still = [u for u in asleep if u not in failed]
        if still:
            raise RunError(f"engine weights still asleep after wake_up, refusing to push: {', '.join(still)}")
        for url in failed:
            log.warning("%s did not wake (%s): left out of this push", url, result.results[url])
            self.events.record("weights.engine_gone", url=url, reason=result.results[url])
        return [now.get(e.url, e) for e in targets if e.url not in failed]

    # --- checkpoints and eval -------------------------------------------------------------------
    async def save(self, rollout_id: int, weight_version: int, wait: bool = True) -> CheckpointResult:
        """Checkpoint the awake trainer with the run state a resume needs (data position, the
        weights' version). ``wait=False``: returns once the state is copied off the model, and
        `checkpoint_written` completes it; ``seconds`` is the time the loop waited."""
        t0 = time.perf_counter()
        run_state = {
            "run_id": self.ctx.run_id,
            "weight_version": weight_version,
            "data_state": await self.rollout.data_state(),
        }
        self.save_started = t0
        path = await asyncio.to_thread(self.backend.save, rollout_id, run_state, wait)
        seconds = time.perf_counter() - t0
        self.events.record(
            "trainer.save", path=path, weight_version=weight_version, seconds=round(seconds, 3)
        )
        if wait:
            self.checkpoint_done(path)
        return CheckpointResult(
            rollout_id=rollout_id,
            next_rollout_id=rollout_id + 1,
            path=path,
            weight_version=weight_version,
            seconds=seconds,
        )

    async def checkpoint_written(self) -> str | None:
        """The checkpoint a ``wait=False`` save left being written, completed once every rank has
        written its files; its path (None: none was being written)."""
        path = await asyncio.to_thread(self.backend.saved)
        if path is not None:
            self.checkpoint_done(path)
        return path

    def checkpoint_done(self, path: str) -> None:
        """``trainer.saved``: the checkpoint counts now (``seconds`` since its save began)."""
        seconds = round(time.perf_counter() - self.save_started, 3)
        self.events.record("trainer.saved", path=path, seconds=seconds)
        self.ctx.status.checkpoint = path

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        """An eval rollout on the synced engines; admission may be paused (it gates training only)."""
        self.events.record("eval.start")
        try:
            job = await self.rollout.rollout(rollout_id, evaluation=True)
        except ServiceCallError as exc:
            if exc.status_code != 400:
                raise
            self.events.record("eval.skipped", reason=exc.message)
            return {}
        self.events.record("eval.done", samples=job.num_samples)
        return dict(job.metrics)

    async def close(self) -> None:
        if self.sync is not None:
            await self.sync.aclose()  # what a failed push left open, while the ranks still run
        await asyncio.to_thread(self.backend.shutdown)


def train_metrics(steps: list[dict[str, float]], prefix: str = "train") -> dict[str, float]:
    """The mean (for ``*_max``: the max) over the optimizer steps of each trainer metric, as
    ``<prefix>/<name>``."""
    keys = sorted({k for s in steps for k in s})
    out = {
        f"{prefix}/{k}": float(
            (max if k.endswith("_max") else statistics.fmean)(float(s[k]) for s in steps if k in s)
        )
        for k in keys
    }
    out[f"{prefix}/optimizer_steps"] = float(len(steps))
    return out


def batch_metrics(shares: Sequence[ShareSummary]) -> dict[str, float]:
    """What the trained samples carried: their count, the weight versions that generated them, and
    how they were split (seed: 4 DP ranks × 64 samples in 8 micro-batches each)."""
    versions = [v for s in shares for v in s.weight_versions]
    per_rank = [float(s.samples) for s in shares] or [0.0]
    micro = [float(s.micro_batches) for s in shares] or [0.0]
    return {
        "batch/samples": float(sum(s.samples for s in shares)),
        "batch/weight_version_min": float(min(versions, default=-1)),
        "batch/weight_version_max": float(max(versions, default=-1)),
        "batch/first_weight_version_min": float(min((s.first_weight_version for s in shares), default=-1)),
        "batch/dp_ranks": float(len(shares)),
        "batch/rank_samples_min": min(per_rank),
        "batch/rank_samples_max": max(per_rank),
        "batch/rank_micro_batches_min": min(micro),
        "batch/rank_micro_batches_max": max(micro),
    }
