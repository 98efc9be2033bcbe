"""The async mode's driver loop, readable in one screen (`AsyncController.run`).

Start-up is the seed's steps 1–13 (`Controller.start_up`; nothing sleeps in this mode). Then the
rollout manager's producer generates rollout after rollout into Redis, and each step of the
trainer takes the newest batch at most ``max_staleness`` versions old (the others dropped), trains
it, and pushes the new weights in flight: admission paused without draining (step 44's async
branch), the engines paused with ``inflight_update`` (``keep``: their requests go on with the new
weights), resumed. A step's ``T_rollout`` is the time the trainer waited for a batch (generation
that training did not hide); ``async/overlap`` is the share of the train phase the producer was
generating. The run ends when the batch of its last rollout has been trained or dropped, or on a
stop: the producer stops first (its rollout under way goes back to the data source), so the last
checkpoint's data position is right after the batches published.
"""

from __future__ import annotations

import logging

from vime.wire.trainer import RunState
from vime_trainer.async_batches import Pick
from vime_trainer.async_ops import AsyncOps
from vime_trainer.controller import Controller
from vime_trainer.ops import RunStopped
from vime_trainer.state import StepClock

log = logging.getLogger("vime.trainer.run")


class AsyncController:
    def __init__(self, base: Controller) -> None:
        """``base``: the synchronous controller, for start-up, checkpoints, eval and step records."""
        self.base, self.ops, self.ctx, self.cfg = base, base.ops, base.ctx, base.cfg
        self.async_ops = AsyncOps(base.ops)
        base.push_mode = self.cfg.inflight_update
        self.consumed = 0
        """One past the newest rollout whose batch was trained or dropped."""

    async def run(self) -> RunState:
        try:
            self.consumed = await self.base.start_up()  # 1–13
            await self.async_ops.start_producer(self.consumed, self.base.resumed)
            while self.consumed < self.cfg.num_rollout and not self.ctx.stop_requested:
                if not await self.step():
                    break
        except RunStopped:
            pass
        except BaseException:
            await self.async_ops.stop_producer(quiet=True)
            raise
        return await self.finish()

    async def step(self) -> bool:
        """One trainer step; False when a stop came while it waited for a batch."""
        await self.base.serve_push_requests()
        clock = StepClock(self.ctx)
        with clock.phase("rollout"):  # waiting for a batch: the generation training did not hide
            await self.ops.push_catch_up()
            pick = await self.async_ops.next_batch()
        if pick is None:
            return False
        rollout_id = pick.entry.rollout_id
        self.ctx.set_rollout(rollout_id)
        self.consumed = max(self.consumed, rollout_id + 1, *(d.rollout_id + 1 for d in pick.dropped))
        with clock.phase("save"):
            await self.base.written()  # the last save's files, written since
        with clock.phase("train"):  # 37–42
            metrics = await self.async_ops.train(pick.entry)
        with clock.phase("save"):
            await self.maybe_save(rollout_id)
        with clock.phase("weight_sync"):  # 44–53, in flight
            was_paused = await self.ops.pause_rollout_admission()
            version = self.ops.version + 1
            await self.ops.update_weights(version, self.base.flush(version), mode=self.cfg.inflight_update)
            await self.ops.resume_rollout_admission(was_paused)
        with clock.phase("eval"):
            metrics |= await self.base.maybe_eval(rollout_id)
        self.base.step_done(rollout_id, clock, self.step_metrics(pick, metrics))  # 55
        return True

    async def maybe_save(self, rollout_id: int) -> None:
        """At save_interval (written until the next training), the last rollout or a checkpoint
        request (complete before the loop goes on); a stop's checkpoint is taken by `finish`,
        once the producer has stopped."""
        c = self.cfg
        final = rollout_id + 1 == c.num_rollout or bool(self.ctx.checkpoint_requests)
        if final or (c.save_interval is not None and (rollout_id + 1) % c.save_interval == 0):
            await self.base.save(rollout_id, self.ops.version + 1, wait=final)

    def step_metrics(self, pick: Pick, metrics: dict[str, float]) -> dict[str, float]:
        return {
            **pick.entry.metrics,
            **metrics,
            **self.ops.push_metrics,
            "async/staleness": float(pick.staleness),
            "async/waiting": float(pick.waiting),
            "async/dropped": float(len(pick.dropped)),
            "async/dropped_total": float(self.ctx.status.dropped_batches),
        }

    async def save_after_fault(self) -> None:
        """As the synchronous loop's: `run` has stopped the producer on its way out, and a fault
        while waiting for a batch leaves the weights of the last finished step, which are saved."""
        await self.base.save_after_fault()

    async def finish(self) -> RunState:
        if self.async_ops.batches is not None:  # the producer was started
            await self.async_ops.stop_producer()
        self.ctx.status.next_rollout_id = max(self.ctx.status.next_rollout_id or 0, self.consumed)
        return await self.base.finish()
