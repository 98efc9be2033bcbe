"""The driver loop: seed steps 1–55, in the seed's order, readable in one screen (`Controller.run`).

Every sleep and wake of the trainer and the engines is a line here; nothing else sleeps or wakes
them. Start-up runs the supervised warm-up (``trainer.sft_warmup_steps``) right after the
trainer's ranks start, before the first weight push. Colocated memory order of every step: the
engines sleep (level 2, weights dropped) → the trainer wakes, trains, (saves), sleeps → the
engines wake their ``weights`` → the push → admission resumes → the engines wake their KV cache.
A step's checkpoint is taken between training and the trainer's sleep, while it is awake and the
engines asleep; a stop that lands after that point wakes the trainer once more at the end for
its checkpoint (the engines are awake then). A ``save_interval`` checkpoint's files are written in
the background during the next rollout: it completes before the next step trains. A resumed run
republishes the checkpoint's weights under the version they were (or were about to be) published
as, so versions continue as if uninterrupted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vime.algorithms import should_flush_cache
from vime.wire.engine import PauseMode
from vime.wire.trainer import CheckpointResult, RunPhase, RunState, StepRecord
from vime_trainer.megatron.checkpoint import checkpoint_path
from vime_trainer.ops import RunOps, RunStopped
from vime_trainer.state import RunContext, StepClock

log = logging.getLogger("vime.trainer.run")

StepHook = Callable[[StepRecord], None]
WarmupHook = Callable[[int, dict[str, float]], None]


class Controller:
    def __init__(
        self,
        ctx: RunContext,
        ops: RunOps,
        *,
        on_step: StepHook = lambda step: None,
        on_warmup: WarmupHook = lambda step, metrics: None,
    ) -> None:
        """``on_step`` / ``on_warmup``: told of every finished RL step / warm-up step (the run's record)."""
        self.ctx, self.ops, self.cfg = ctx, ops, ctx.cfg
        self.on_step, self.on_warmup = on_step, on_warmup
        self.saved_rollout: int | None = None
        """The rollout id of the newest checkpoint this run wrote."""
        self.saved_version = 0
        """The weight version that checkpoint is published as."""
        self.pending: CheckpointResult | None = None
        """A save whose files the ranks are still writing (an interval save does not wait)."""
        self.last_done: int | None = None
        self.trained: tuple[int, StepClock, dict[str, float]] | None = None
        """The step trained but not yet recorded (its rollout id, clock and metrics so far)."""
        self.resumed: dict[str, Any] | None = None
        """The run state of the checkpoint this run resumed from (None: a fresh start)."""
        self.push_mode: PauseMode | None = None
        """How a requested push pauses the engines (None: seed step 46's; the async mode's in flight)."""

    async def run(self) -> RunState:
        try:
            first = await self.start_up()  # steps 1–13
        except RunStopped:
            return await self.finish()
        for rollout_id in range(first, self.cfg.num_rollout):
            if self.ctx.stop_requested:
                break
            self.ctx.set_rollout(rollout_id)
            await self.serve_push_requests()
            clock = StepClock(self.ctx)
            with clock.phase("rollout"):  # 14–32
                await self.ops.push_catch_up()
                job = await self.ops.generate(rollout_id)
            with clock.phase("offload"):  # 33–36
                await self.ops.offload()
            with clock.phase("save"):
                await self.written()  # the last save's files, written during the rollout
            with clock.phase("train"):  # 37–40
                await self.ops.trainer_wake_up()  # 37
                metrics = await self.ops.train(rollout_id, job)
            self.trained = (rollout_id, clock, {**job.metrics, **metrics})
            with clock.phase("save"):  # save_interval, the last rollout, a stop or a request
                await self.maybe_save(rollout_id)
            with clock.phase("train"):
                await self.ops.trainer_sleep(keep_weights=True)  # 41, the push reads them on the GPU
                await self.ops.training_completed(rollout_id)  # 42
            with clock.phase("onload_weights"):  # 43
                await self.ops.onload_weights()
            with clock.phase("weight_sync"):  # 44–53
                was_paused = await self.ops.pause_rollout_admission()
                await self.ops.update_weights(self.ops.version + 1, self.flush(self.ops.version + 1))
                await self.ops.trainer_drop_weights()  # 41's weights leave the GPU
                if rollout_id + 1 < self.cfg.num_rollout:
                    await self.ops.resume_rollout_admission(was_paused)
            with clock.phase("onload_kv"):  # 54
                await self.ops.onload_kv()
            with clock.phase("eval"):
                metrics |= await self.maybe_eval(rollout_id)
            parts = self.ops.push_metrics | self.ops.trainer_memory_metrics
            self.step_done(rollout_id, clock, {**job.metrics, **metrics, **parts})  # 55
        return await self.finish()

    # --- start-up: seed steps 1–13 ----------------------------------------------------------------
    async def start_up(self) -> int:
        """Engines started (asleep when offloaded), trainer started (or resumed), weights v1 pushed."""
        resume = self.cfg.start_rollout_id is None
        self.ctx.events.record("run.start", num_rollout=self.cfg.num_rollout, resume=resume)
        rollout = await self.ops.wait_rollout_manager()  # 2
        # The newest version the engines served, in an earlier run too (one restarted since holds 0).
        held = max([rollout.weight_version, *(e.weight_version or 0 for e in rollout.engines)])
        state = await self.ops.start_trainer(resume)  # 3
        if state is None:  # a checkpoint already holds the warmed-up weights
            await self.warm_up()
        first, version = self.cfg.start_rollout_id or 0, held + 1
        if state is not None:
            run_state = self.resumed = state.get("run_state") or {}
            first = int(state["next_rollout_id"])
            saved = int(run_state.get("weight_version", 0))
            version = saved if saved >= held else held + 1  # the checkpoint's weights keep their version
            if run_state.get("data_state") is not None:
                await self.ops.rollout.set_data_state(run_state["data_state"])
            self.ctx.status.checkpoint = str(
                checkpoint_path(self.cfg.trainer.checkpoint_dir, int(state["rollout_id"]))
            )
            self.ctx.events.record("run.resume", next_rollout_id=first, weight_version=version)
        self.ctx.status.start_rollout_id = self.ctx.status.next_rollout_id = first
        self.ops.version = self.ops.start_version = held
        await self.ops.trainer_sleep(keep_weights=True)  # Megatron sleeps before the engines wake
        await self.ops.onload_weights()  # 4–7
        await self.ops.update_weights(version, flush=True)  # 8: first push, always flushes
        await self.ops.trainer_drop_weights()  # the weights the push read leave the GPU
        await self.ops.training_ready()  # 9
        await self.ops.onload_kv()  # 10–13
        return first

    async def warm_up(self) -> None:
        """``trainer.sft_warmup_steps`` supervised steps on the labels, before the first push (so
        the engines' first weights are the warmed-up ones) and while the engines still sleep."""
        steps = self.cfg.trainer.sft_warmup_steps
        if not steps:
            return
        self.ctx.set_phase(RunPhase.WARMUP)
        self.ctx.events.record("sft.start", steps=steps)
        t0, losses = time.perf_counter(), []
        for step in range(steps):
            if self.ctx.stop_requested:
                raise RunStopped()
            metrics = await self.ops.sft_step(step, steps)
            losses.append(round(metrics.get("sft/loss", float("nan")), 5))
            self.on_warmup(step, metrics)
        seconds = round(time.perf_counter() - t0, 3)
        self.ctx.events.record(
            "sft.done", steps=steps, loss_first=losses[0], loss_last=losses[-1], seconds=seconds
        )
        self.ctx.set_phase(RunPhase.STARTING)

    def flush(self, version: int) -> bool:
        return should_flush_cache(self.cfg.flush_cache_interval, version, self.ops.start_version)

    # --- checkpoints, eval, requests ------------------------------------------------------------
    async def maybe_save(self, rollout_id: int) -> None:
        """At save_interval (its files written during the next rollout), and, complete before the
        loop goes on, at the last rollout, a stop or a request."""
        c = self.cfg
        final = (
            rollout_id + 1 == c.num_rollout or self.ctx.stop_requested or bool(self.ctx.checkpoint_requests)
        )
        if final or (c.save_interval is not None and (rollout_id + 1) % c.save_interval == 0):
            await self.save(rollout_id, self.ops.version + 1, wait=final)  # published next as version + 1

    async def save(self, rollout_id: int, weight_version: int, wait: bool = True) -> CheckpointResult:
        self.ctx.set_phase(RunPhase.SAVE)
        await self.written()  # one save is written at a time
        result = await self.ops.save(rollout_id, weight_version, wait)
        if wait:
            self.saved_rollout, self.saved_version = rollout_id, weight_version
        else:
            self.pending = result
        for fut in self.ctx.checkpoint_requests:  # a request's save waits
            if not fut.done():
                fut.set_result(result)
        self.ctx.checkpoint_requests.clear()
        return result

    async def written(self) -> None:
        """The pending save's checkpoint, completed once every rank has written its files (the
        ranks may be asleep)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        await self.ops.checkpoint_written()
        self.saved_rollout, self.saved_version = pending.rollout_id, pending.weight_version

    async def maybe_eval(self, rollout_id: int) -> dict[str, float]:
        interval = self.cfg.eval_interval
        if interval is None or (rollout_id + 1) % interval:
            return {}
        self.ctx.set_phase(RunPhase.EVAL)
        return await self.ops.evaluate(rollout_id)

    async def serve_push_requests(self) -> None:
        """``POST /v1/weights/push``, served at a step boundary (engines awake, trainer asleep)."""
        if not self.ctx.push_requests:
            return
        self.ctx.set_phase(RunPhase.WEIGHT_SYNC)
        version = self.ops.version + 1
        result = await self.ops.update_weights(version, self.flush(version), mode=self.push_mode)
        for fut in self.ctx.push_requests:
            if not fut.done():
                if result is None:
                    fut.set_exception(RuntimeError("no live engine to push to"))
                else:
                    fut.set_result(result)
        self.ctx.push_requests.clear()

    def step_done(
        self, rollout_id: int, clock: StepClock, metrics: dict[str, float], weight_version: int | None = None
    ) -> None:
        step = StepRecord(
            rollout_id=rollout_id,
            weight_version=self.ops.version if weight_version is None else weight_version,
            timings=clock.timings(),
            metrics=metrics,
            finished_at=time.time(),
        )
        self.last_done, self.trained = rollout_id, None
        self.ctx.step_done(step)
        self.ctx.events.record("step.done", step_s=round(step.timings.step_s, 4))
        self.on_step(step)

    async def finish(self) -> RunState:
        """A stop that came after the step's save point still leaves a checkpoint of that step."""
        await self.save_last_step()
        self.ctx.set_phase(RunPhase.DONE)
        next_id = self.ctx.status.next_rollout_id
        return (
            RunState.FINISHED if next_id is not None and next_id >= self.cfg.num_rollout else RunState.STOPPED
        )

    async def save_last_step(self) -> None:
        """Checkpoint the last finished step unless that is done (its weights are pushed: they
        keep their version)."""
        await self.written()
        if self.last_done is not None and self.saved_rollout != self.last_done:
            await self.ops.trainer_wake_up()
            await self.save(self.last_done, self.ops.version)
            await self.ops.trainer_sleep()
            log.info("run %s: checkpoint after rollout %d", self.ctx.run_id, self.last_done)

    async def save_after_fault(self) -> None:
        """A run that failed or was cancelled between two steps — in a rollout or the offload after
        it, where the trainer's weights are still those of the last finished step — checkpoints
        that step, so a resume loses nothing it trained. Anywhere else (training, a save, a push)
        the weights may be half-way between two steps, and the last checkpoint stays the newest.
        A step checkpointed but not yet recorded (a fault between its save and its end) is recorded
        now with the metrics it had: a resume starts after it."""
        try:
            await self.written()
        except Exception as exc:  # a write that failed leaves an incomplete directory: resumes skip it
            log.warning(
                "run %s: the last checkpoint was not completed: %s: %s",
                self.ctx.run_id,
                type(exc).__name__,
                exc,
            )
        if self.trained is not None and self.trained[0] == self.saved_rollout:
            rollout_id, clock, metrics = self.trained
            self.step_done(rollout_id, clock, metrics, weight_version=self.saved_version)
            return
        if self.ctx.status.phase not in (RunPhase.ROLLOUT, RunPhase.OFFLOAD):
            return
        try:
            await self.save_last_step()
        except Exception as exc:  # the fault may have taken what a save needs (the rollout manager)
            log.warning(
                "run %s: no checkpoint after the fault: %s: %s", self.ctx.run_id, type(exc).__name__, exc
            )
