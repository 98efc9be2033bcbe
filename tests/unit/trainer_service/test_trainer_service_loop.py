"""The driver loop (seed steps 1–55) against in-process stand-ins: the seed's order of actions,
weight versions 1 → 2 → 3, where checkpoints go and what they carry, stop and resume, restarted
engines, the push guard, eval, requests from the REST app, the flush interval."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from engine_fakes import FakeEngines, FakeTransport
from trainer_fakes import FakeBackend, FakeRollout
from vime_trainer.controller import Controller
from vime_trainer.events import EventLog
from vime_trainer.ops import RunError, RunOps
from vime_trainer.state import RunContext
from vime_trainer.weight_sync import WeightSync

from tests.support.run_events import DROP, PUSH, SAVE, STEP, SYNC, TRAIN, TRAINED, action_names
from vime.config import load_config
from vime.wire.trainer import RunState

BASE = [
    "rollout_num_gpus=0",
    "actor_num_gpus_per_node=0",
    "rollout_batch_size=2",
    "n_samples_per_prompt=4",
    "micro_batch_size=4",
    "tensor_model_parallel_size=1",
    "num_rollout=2",
]


class Run:
    def __init__(self, *overrides: str, backend: FakeBackend | None = None, version: int = 0) -> None:
        self.cfg = load_config(overrides=[*BASE, *overrides], environ={})
        self.events = EventLog()
        self.ctx = RunContext("r", self.cfg, self.events)
        self.engines = FakeEngines(2)
        self.rollout = FakeRollout(
            self.engines.urls(), offloaded=bool(self.cfg.offload_rollout), version=version
        )
        self.backend = backend or FakeBackend()
        self.backend.version = lambda: self.rollout.version  # batches carry what the engines held
        self.transport = FakeTransport(2)
        self.ops = RunOps(
            self.ctx,
            self.rollout,  # type: ignore[arg-type]
            self.backend,
            make_sync=lambda b: WeightSync(
                self.transport,
                on_event=self.events.record,
                client_factory=self.engines.client,
                reset_interval_s=0,
            ),
        )
        self.steps: list[Any] = []
        self.warm: list[tuple[int, dict[str, float]]] = []
        self.controller = Controller(
            self.ctx, self.ops, on_step=self.steps.append, on_warmup=lambda s, m: self.warm.append((s, m))
        )

    async def go(self) -> RunState:
        return await self.controller.run()

    def actions(self, rollout_id: Any = "all") -> list[str]:
        """The action names of one rollout's events ("all": of every event)."""
        return action_names(
            e.model_dump() for e in self.events.events if rollout_id == "all" or e.rollout_id == rollout_id
        )


async def test_fresh_run_follows_the_seed_order_and_versions() -> None:
    run = Run()
    assert await run.go() is RunState.FINISHED
    assert run.actions(None) == [
        "run.start",
        "rollout.ready",
        "trainer.start",
        "trainer.load",
        "trainer.sleep",  # 2, 3; Megatron sleeps first
        "engines.onload(weights)",
        *PUSH,  # 4–8: v1
        DROP,
        "rollout.training_ready",
        "engines.onload(kv_cache)",  # 9–13
    ]
    assert run.actions(0) == [*STEP, *SYNC, "admission.resume", "engines.onload(kv_cache)", "step.done"]
    # The last rollout saves after training, while the trainer is awake (one wake and one sleep for
    # the step), and skips resuming admission (seed step 53).
    assert run.actions(1) == [
        *TRAIN,
        *SAVE,
        *TRAINED,
        *SYNC,
        "engines.onload(kv_cache)",
        "step.done",
    ]
    # Every sleep and wake is the loop's: the ranks refuse work while asleep, and a save costs nothing extra.
    assert run.backend.calls == [
        *["start", "load", "sleep keeping weights", "drop_weights"],
        *["wake_up", "train 0", "sleep keeping weights", "drop_weights"],
        *["wake_up", "train 1", "save 1", "sleep keeping weights", "drop_weights"],
    ]
    assert run.rollout.version == 3 and {s.version for s in run.engines.states.values()} == {"3"}
    assert [s.metrics["batch/weight_version_max"] for s in run.steps] == [1.0, 2.0]  # samples carry v1, v2
    assert [s.weight_version for s in run.steps] == [2, 3]
    assert run.backend.checkpoints[1]["run_state"]["weight_version"] == 3  # published next as v3
    assert run.ctx.status.next_rollout_id == 2 and run.ctx.status.steps_done == 2
    assert run.rollout.admission_paused
    refs = [(r.run_id, r.batch_id, r.rollout_id) for r in run.backend.refs]
    assert refs == [("mgr", "mgr:0:0", 0), ("mgr", "mgr:1:0", 1)]  # the stream named by the rollout's reply
    t = run.steps[0].timings
    assert t.step_s == pytest.approx(
        t.rollout_s + t.offload_s + t.train_s + t.onload_weights_s + t.weight_sync_s + t.onload_kv_s
    )


async def test_each_step_reports_the_trainer_wake_up_and_sleep_inside_t_train() -> None:
    run = Run()
    run.backend.memory_s = 0.05
    run.backend.sleep_memory = {"peak_gib": 31.5, "asleep_reserved_gib": 0.25}
    await run.go()
    for step in run.steps:
        wake, sleep = step.metrics["trainer/wake_s"], step.metrics["trainer/sleep_s"]
        assert 0.05 <= wake < 1.0 and 0.05 <= sleep < 1.0
        assert wake + sleep <= step.timings.train_s
        assert (step.metrics["trainer/peak_gib"], step.metrics["trainer/asleep_reserved_gib"]) == (31.5, 0.25)


async def test_a_colocated_trainer_without_offload_still_frees_what_needs_no_copy() -> None:
    run = Run("offload_train=false")
    await run.go()
    sleeps = [c for c in run.backend.calls if c.startswith("sleep")]
    assert sleeps and set(sleeps) == {"sleep without offload keeping weights"}  # start-up, then every step
    assert len(sleeps) == 1 + len(run.steps)
    assert all("trainer/wake_s" in s.metrics and "trainer/sleep_s" in s.metrics for s in run.steps)


async def test_a_trainer_on_its_own_gpus_never_sleeps() -> None:
    run = Run("offload_train=false", "offload_rollout=false", "colocate=false")
    await run.go()
    assert run.steps and not any(c.startswith(("sleep", "wake_up")) for c in run.backend.calls)
    assert not any("trainer/wake_s" in s.metrics or "trainer/sleep_s" in s.metrics for s in run.steps)


async def test_batches_the_ranks_skipped_are_in_the_event_log() -> None:
    run = Run()
    run.backend.skipped = [("mgr:3:0", 3)]  # left pending by the run this one resumed from
    await run.go()
    skipped = [e.detail for e in run.events.events if e.action == "trainer.skipped"]
    assert skipped == [{"batches": ["mgr:3:0"]}]
    assert run.actions(0)[:6] == [*TRAIN, "trainer.skipped"]


async def test_trainer_sleeps_before_engine_weights_wake() -> None:
    run = Run()
    seen: list[bool] = []
    orig = run.rollout.onload

    async def onload(tags: Any = None) -> Any:
        if tags == ["weights"]:
            seen.append(run.backend.asleep)
        return await orig(tags)

    run.rollout.onload = onload  # type: ignore[method-assign]
    await run.go()
    assert seen == [True, True, True]


async def test_stop_during_training_checkpoints_that_step_and_ends_after_it() -> None:
    run = Run("num_rollout=3")
    run.backend.on_train = lambda rid: run.ctx.request_stop() if rid == 0 else None
    assert await run.go() is RunState.STOPPED
    assert [s.rollout_id for s in run.steps] == [0]
    assert list(run.backend.checkpoints) == [0]
    assert run.backend.checkpoints[0]["run_state"]["weight_version"] == 2
    assert run.rollout.version == 2 and not run.rollout.admission_paused  # the step finished normally
    assert run.ctx.status.next_rollout_id == 1


async def test_stop_after_the_save_point_checkpoints_after_the_step() -> None:
    run = Run("num_rollout=3")
    run.transport.on_bucket = lambda i: run.ctx.request_stop() if run.ctx.status.rollout_id == 0 else None
    assert await run.go() is RunState.STOPPED
    assert list(run.backend.checkpoints) == [0]
    assert run.backend.checkpoints[0]["run_state"]["weight_version"] == 2  # already published as v2
    assert run.actions(0)[-5:] == ["step.done", "trainer.wake_up", *SAVE, "trainer.sleep"]


async def test_resume_continues_at_the_checkpoint_with_the_same_versions() -> None:
    data = {"epoch": 0, "sample_group_index": 2}
    saved = {
        0: {"rollout_id": 0, "next_rollout_id": 1, "run_state": {"weight_version": 2, "data_state": data}}
    }
    run = Run("num_rollout=3", backend=FakeBackend(checkpoints=saved), version=2)
    assert await run.go() is RunState.FINISHED
    assert ("set_data_state", data) in run.rollout.calls
    loaded = [v for name, v in run.rollout.calls if name == "weights_loaded"]
    assert [v[0] for v in loaded] == [2, 3, 4]  # the checkpoint's weights keep v2
    assert [s.rollout_id for s in run.steps] == [1, 2]
    assert [s.metrics["batch/weight_version_max"] for s in run.steps] == [2.0, 3.0]
    assert run.ctx.status.start_rollout_id == 1


async def test_a_new_run_starts_above_the_version_the_stack_served_when_the_engines_restarted() -> None:
    """An earlier run on this stack reached v2 and its engine was restarted since (it holds 0):
    the rollout manager refuses a version below its own, so the first push is v3, not v1."""
    run = Run("num_rollout=1", version=2)
    for e in run.rollout.engines_:
        e.weight_version = 0
    assert await run.go() is RunState.FINISHED
    loaded = [v for name, v in run.rollout.calls if name == "weights_loaded"]
    assert [v[0] for v in loaded] == [3, 4]


async def test_admission_a_finished_run_left_paused_opens_at_training_ready() -> None:
    run = Run()
    run.rollout.admission_paused = True  # the previous run's last step skipped step 53
    assert await run.go() is RunState.FINISHED  # the fake refuses a rollout while paused
    pauses = [e.detail for e in run.events.events if e.action.startswith("admission.")]
    assert pauses == [  # rollout 0: the pause found it open and is undone; rollout 1 keeps it
        {"was_paused": False},
        {"was_paused": False, "paused": False},
        {"was_paused": False},
    ]
    assert run.rollout.admission_paused


async def test_resume_behind_the_engines_takes_a_newer_version() -> None:
    saved = {0: {"rollout_id": 0, "next_rollout_id": 1, "run_state": {"weight_version": 2}}}
    run = Run("num_rollout=2", backend=FakeBackend(checkpoints=saved), version=5)
    await run.go()
    assert [v[0] for name, v in run.rollout.calls if name == "weights_loaded"] == [6, 7]


async def test_a_restarted_engine_gets_the_current_weights_before_the_next_rollout() -> None:
    run = Run()
    orig = run.rollout.onload

    async def onload(tags: Any = None) -> Any:
        out = await orig(tags)
        if tags == ["kv_cache", "cuda_graph"] and run.ctx.status.rollout_id == 0:
            e = run.rollout.engines_[
                1
            ]  # restarted by the rollout manager: checkpoint weights, out of the router
            e.status, e.needs_weights, e.weight_version = "needs_weights", True, 0
        return out

    run.rollout.onload = onload  # type: ignore[method-assign]
    await run.go()
    loaded = [v for name, v in run.rollout.calls if name == "weights_loaded"]
    assert loaded[2] == (2, ("http://e1",))  # the catch-up push: current version, that engine only
    events = [e.detail for e in run.events.events if e.action == "weights.loaded"]
    assert [(d["version"], d["engines"], d["catch_up"]) for d in events][1:3] == [
        (2, ["http://e0", "http://e1"], False),
        (2, ["http://e1"], True),
    ]
    assert run.actions(1)[:2] == ["weights.push", "weights.pause"]
    assert run.rollout.calls.index(("rollout", 1)) > run.rollout.calls.index(("weights_loaded", loaded[2]))


async def test_the_push_guard_refuses_engines_whose_weights_stay_asleep() -> None:
    run = Run()
    run.rollout.keep_asleep = {"http://e1"}
    with pytest.raises(RunError, match=r"still asleep.*http://e1"):
        await run.go()
    assert not any(c[0] == "update_weights" for s in run.engines.states.values() for c in s.calls)
    assert ("release_update_lock", "L0") in run.rollout.calls


async def test_an_engine_that_does_not_wake_for_the_push_is_left_out_of_it() -> None:
    """It died while asleep and the monitor has not seen it yet: the run goes on without it (the
    rollout manager keeps it out of the router until a push brings it the version)."""
    run = Run()
    run.rollout.fail_wake = {"http://e1"}
    assert await run.go() is RunState.FINISHED
    loaded = [v for name, v in run.rollout.calls if name == "weights_loaded"]
    assert [v for v in loaded if v[1]] == [(1, ("http://e0",)), (2, ("http://e0",)), (3, ("http://e0",))]
    assert all(urls in ((), ("http://e0",)) for _, urls in loaded)  # () : a catch-up that reached nobody
    assert not any(c[0] == "update_weights" for c in run.engines.states["http://e1"].calls)
    gone = {e.detail["url"] for e in run.events.events if e.action == "weights.engine_gone"}
    assert gone == {"http://e1"}


async def test_eval_every_interval_runs_with_admission_still_paused_after_the_last_step() -> None:
    run = Run("eval_interval=1")
    await run.go()
    assert [c for c in run.rollout.calls if c[0] == "eval"] == [("eval", 0), ("eval", 1)]
    assert run.actions(1)[-4:] == ["engines.onload(kv_cache)", "eval.start", "eval.done", "step.done"]
    assert "admission.resume" not in run.actions(1) and run.rollout.admission_paused  # step 53 skipped
    assert run.steps[0].metrics["eval/x/reward_mean"] == 0.5 and run.steps[0].timings.eval_s > 0
    run = Run("eval_interval=1")
    run.rollout.eval_available = False
    assert await run.go() is RunState.FINISHED
    assert "eval.skipped" in run.actions()


async def test_push_and_checkpoint_requests_are_served_at_their_points() -> None:
    run = Run("num_rollout=3")

    async def ask() -> None:
        run.push = run.ctx.request_push()
        run.ckpt = run.ctx.request_checkpoint()

    orig = run.rollout.training_ready

    async def ready() -> Any:
        await ask()
        return await orig()

    run.rollout.training_ready = ready  # type: ignore[method-assign]
    await run.go()
    assert run.push.result().version == 2 and run.ckpt.result().rollout_id == 0
    assert [v[0] for name, v in run.rollout.calls if name == "weights_loaded"] == [1, 2, 3, 4, 5]
    assert sorted(run.backend.checkpoints) == [0, 2]


async def test_without_colocation_nothing_sleeps() -> None:
    run = Run("colocate=false")
    await run.go()
    acts = run.actions()
    assert not any(a.startswith(("engines.offload", "engines.onload", "trainer.sleep")) for a in acts)
    assert run.rollout.version == 3


async def test_flush_interval_aborts_and_flushes_every_nth_version() -> None:
    run = Run("flush_cache_interval=2", "num_rollout=3")
    await run.go()
    modes = [c[1]["mode"] for c in run.engines.states["http://e0"].calls if c[0] == "pause"]
    assert modes == ["abort", "keep", "abort", "keep"]  # v1 (first push), v2, v3, v4


async def test_sft_warm_up_runs_after_the_ranks_start_and_before_the_first_push() -> None:
    run = Run("trainer.sft_warmup_steps=3", "actor_num_cpu_ranks=2", backend=FakeBackend(dp_size=2))
    phases: list[str] = []
    run.backend.on_train_sft = lambda step: phases.append(run.ctx.status.phase.value)
    assert await run.go() is RunState.FINISHED
    assert run.actions(None)[:11] == [
        "run.start",
        "rollout.ready",
        "trainer.start",
        "trainer.load",  # no checkpoint: a fresh run warms up
        "sft.start",
        "sft.step",
        "sft.step",
        "sft.step",
        "sft.done",
        "trainer.sleep",
        "engines.onload(weights)",  # then the first push (v1) carries the warmed-up weights
    ]
    assert run.backend.calls[:5] == ["start", "load", "train_sft 0", "train_sft 1", "train_sft 2"]
    assert phases == ["warmup"] * 3
    assert [v for name, v in run.rollout.calls if name == "sft"] == [(0, 2), (1, 2), (2, 2)]
    assert [r.run_id for r in run.backend.refs] == ["mgr:sft"] * 3 + ["mgr"] * 2  # warm-up stream, then RL
    assert [r.batch_id for r in run.backend.refs[:3]] == ["mgr:sft:0:0", "mgr:sft:1:0", "mgr:sft:2:0"]
    steps = [e.detail for e in run.events.events if e.action == "sft.step"]
    assert [(d["step"], d["steps"], d["loss"]) for d in steps] == [(0, 3, 3.0), (1, 3, 1.5), (2, 3, 1.0)]
    done = next(e.detail for e in run.events.events if e.action == "sft.done")
    assert (done["loss_first"], done["loss_last"]) == (3.0, 1.0)
    assert [s for s, _ in run.warm] == [0, 1, 2] and run.warm[1][1]["sft/loss"] == 1.5
    assert run.warm[0][1]["sft/optimizer_steps"] == 1.0 and run.warm[0][1]["sft/label_len_mean"] == 3.0


async def test_a_resumed_run_does_not_warm_up_again() -> None:
    saved = {0: {"rollout_id": 0, "next_rollout_id": 1, "run_state": {"weight_version": 2}}}
    run = Run("trainer.sft_warmup_steps=3", backend=FakeBackend(checkpoints=saved), version=2)
    assert await run.go() is RunState.FINISHED
    assert not [c for c in run.rollout.calls if c[0] == "sft"] and "sft.start" not in run.actions()


async def test_a_stop_during_the_warm_up_ends_the_run_before_any_push() -> None:
    run = Run("trainer.sft_warmup_steps=5")
    run.backend.on_train_sft = lambda step: run.ctx.request_stop() if step == 1 else None
    assert await run.go() is RunState.STOPPED
    assert [c for c in run.backend.calls if c.startswith("train_sft")] == ["train_sft 0", "train_sft 1"]
    assert "weights.push" not in run.actions() and not run.backend.checkpoints and not run.steps


async def test_an_engine_restarted_inside_a_rollout_gets_the_weights_while_the_rollout_waits() -> None:
    """With one engine, the rollout's generates wait for it; nothing else would push while they do."""
    run = Run("rollout_num_gpus=0", "engine.health_check_interval_s=0.01")
    run.rollout.engines_ = run.rollout.engines_[:1]
    orig = run.rollout.rollout

    async def rollout(rollout_id: int, **kw: Any) -> Any:
        if rollout_id == 1:
            e = run.rollout.engines_[0]  # died mid-rollout, restarted: checkpoint weights, out of the router
            e.status, e.needs_weights, e.weight_version = "needs_weights", True, 0
            for _ in range(500):  # the rollout's requests wait for the engine to serve again
                if run.rollout.engines_[0].status == "ready":
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("no catch-up push while the rollout waited")
        return await orig(rollout_id, **kw)

    run.rollout.rollout = rollout  # type: ignore[method-assign]
    assert await run.go() is RunState.FINISHED
    loaded = [v for name, v in run.rollout.calls if name == "weights_loaded"]
    assert loaded[2] == (2, ("http://e0",))  # pushed inside rollout 1: the current version, that engine
    assert run.actions(1)[:3] == ["rollout.start", "weights.push", "weights.pause"]
    assert [s.rollout_id for s in run.steps] == [0, 1]


async def test_a_run_that_fails_inside_a_rollout_checkpoints_its_last_step() -> None:
    run = Run("num_rollout=4")
    orig = run.rollout.rollout

    async def rollout(rollout_id: int, **kw: Any) -> Any:
        if rollout_id == 2:
            raise RuntimeError("the rollout manager is gone")
        return await orig(rollout_id, **kw)

    run.rollout.rollout = rollout  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="gone"):
        await run.go()
    await run.controller.save_after_fault()
    saved = {k: c["run_state"]["weight_version"] for k, c in run.backend.checkpoints.items()}
    assert saved == {1: 3}  # rollout 1's weights, published as v3
    await run.controller.save_after_fault()
    assert run.backend.calls.count("save 1") == 1


async def test_a_step_that_fails_after_its_checkpoint_is_recorded_once() -> None:
    """A fault between a step's save and its end (here the push after it): the checkpoint is of
    that step, so a resume starts after it, and the step is recorded with the metrics it had.
    The interval save was still being written: the fault handling completes it first."""
    run = Run("num_rollout=4", "save_interval=2")
    orig = run.ops.update_weights

    async def update_weights(version: int, *args: Any, **kw: Any) -> Any:
        pending = run.controller.pending
        if pending is not None and pending.rollout_id == 1 and run.controller.trained is not None:
            raise RuntimeError("the engine is gone")
        return await orig(version, *args, **kw)

    run.ops.update_weights = update_weights  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="gone"):
        await run.go()
    assert [s.rollout_id for s in run.steps] == [0] and run.backend.checkpoints == {}
    await run.controller.save_after_fault()
    assert [s.rollout_id for s in run.steps] == [0, 1]
    assert run.steps[1].weight_version == run.backend.checkpoints[1]["run_state"]["weight_version"] == 3
    assert run.steps[1].metrics and set(run.steps[1].metrics) < set(run.steps[0].metrics)  # no push metrics
    await run.controller.save_after_fault()
    assert [s.rollout_id for s in run.steps] == [0, 1]  # once


async def test_a_run_that_fails_while_training_keeps_the_last_checkpoint() -> None:
    backend = FakeBackend()

    def die(rollout_id: int) -> None:
        if rollout_id == 1:
            raise RuntimeError("rank died")

    backend.on_train = die
    run = Run("num_rollout=3", backend=backend)
    with pytest.raises(RuntimeError, match="rank died"):
        await run.go()
    await run.controller.save_after_fault()
    assert run.backend.checkpoints == {}  # the weights may be half-way through rollout 1's step


async def test_a_run_in_the_mode_the_rollout_manager_was_not_started_in_fails_at_start() -> None:
    run = Run("mode=async", "colocate=false")  # the fake manager says mode=sync
    with pytest.raises(RunError, match="mode=async, but the rollout manager was started with mode=sync"):
        await run.go()
    assert "trainer.start" not in run.actions(None)  # refused before any rank started


async def test_an_interval_save_is_written_during_the_next_rollout() -> None:
    """An interval checkpoint holds the loop only while the state is copied off the model: its
    files are written during the next rollout and it completes before the next step trains (while
    the trainer still sleeps); the last rollout's checkpoint completes before the run ends."""
    run = Run("num_rollout=4", "save_interval=1")
    assert await run.go() is RunState.FINISHED
    calls = [c for c in run.backend.calls if c.startswith(("save", "train ", "wake_up"))]
    assert calls == [
        *["wake_up", "train 0", "save 0 in the background"],
        *["saved 0", "wake_up", "train 1", "save 1 in the background"],
        *["saved 1", "wake_up", "train 2", "save 2 in the background"],
        *["saved 2", "wake_up", "train 3", "save 3"],  # the last one waits
    ]
    assert run.actions(1)[:6] == [*TRAIN[:3], "trainer.saved", *TRAIN[3:]]  # after rollout 1, before training
    saved = [e.detail["path"] for e in run.events.events if e.action == "trainer.saved"]
    assert saved == [f"ckpt/rollout_{i:07d}" for i in range(4)]
    assert run.ctx.status.checkpoint == "ckpt/rollout_0000003" and run.backend.writing is None
    versions = {k: c["run_state"]["weight_version"] for k, c in run.backend.checkpoints.items()}
    assert versions == {k: k + 2 for k in range(4)}  # each published next as its version
    assert all(s.timings.save_s >= 0 for s in run.steps)


async def test_a_stop_after_an_interval_save_completes_it_instead_of_saving_again() -> None:
    run = Run("num_rollout=6", "save_interval=2")
    orig = run.ops.update_weights

    async def update_weights(version: int, *args: Any, **kw: Any) -> Any:
        if run.controller.pending is not None:  # rollout 1's push, its checkpoint still being written
            run.ctx.request_stop()
        return await orig(version, *args, **kw)

    run.ops.update_weights = update_weights  # type: ignore[method-assign]
    assert await run.go() is RunState.STOPPED
    assert [s.rollout_id for s in run.steps] == [0, 1]
    assert sorted(run.backend.checkpoints) == [1] and run.backend.writing is None
    assert [c for c in run.backend.calls if c.startswith("save")] == ["save 1 in the background", "saved 1"]
    assert run.controller.saved_rollout == 1
