"""A run whose trainer rank dies or whose push fails ends FAILED with the cause, its ranks shut down,
its record (metrics of the steps it finished, report.png, summary) still written; a push that fails
releases the rollout manager's update lock and leaves the engines paused."""

from __future__ import annotations

from pathlib import Path

from engine_fakes import FakeEngines, FakeTransport
from trainer_fakes import FakeBackend, FakeRollout
from vime_trainer.runs import RunHandle
from vime_trainer.weight_sync import WeightSync

from vime.config import load_config
from vime.wire.trainer import RunState


def _handle(
    tmp_path: Path, backend: FakeBackend, engines: FakeEngines, transport: FakeTransport, *extra: str
) -> RunHandle:
    cfg = load_config(
        overrides=[
            "rollout_num_gpus=0",
            "actor_num_gpus_per_node=0",
            "tensor_model_parallel_size=1",
            "rollout_batch_size=2",
            "n_samples_per_prompt=4",
            "micro_batch_size=4",
            "num_rollout=3",
            f"output_dir={tmp_path}",
            "run_id=f",
            *extra,
        ],
        environ={},
    )
    handle = RunHandle(cfg, backend, on_step=lambda step: None)
    rollout = FakeRollout(engines.urls())
    handle.ops.rollout = handle.controller.ops.rollout = rollout  # type: ignore[assignment]
    handle.ops.make_sync = lambda b: WeightSync(
        transport, on_event=handle.ctx.events.record, client_factory=engines.client, reset_interval_s=0
    )
    return handle


async def test_a_rank_that_dies_fails_the_run_with_its_cause_and_keeps_the_record(tmp_path: Path) -> None:
    backend = FakeBackend()

    def die(rollout_id: int) -> None:
        if rollout_id == 1:
            raise RuntimeError("a training rank failed: rank 0 died")

    backend.on_train = die
    handle = _handle(tmp_path, backend, FakeEngines(2), FakeTransport(2))
    await handle.run()
    status = handle.ctx.status
    assert status.state is RunState.FAILED and "rank 0 died" in (status.error or "")
    assert status.steps_done == 1 and status.next_rollout_id == 1
    assert backend.calls[-1] == "shutdown"
    summary = status.summary or {}
    assert summary["state"] == "failed" and summary["steps"] == 1 and "rank 0 died" in summary["error"]
    assert (tmp_path / "f" / "report.png").is_file()
    assert len((tmp_path / "f" / "metrics.jsonl").read_text().splitlines()) == 1


async def test_an_async_run_that_fails_ends_failed_with_its_cause(tmp_path: Path) -> None:
    """The async loop's way out of a fault goes through the same end as the synchronous one's: the
    run ends FAILED (it once raised in its clean-up instead, and the run stayed "running")."""
    backend = FakeBackend()
    handle = _handle(tmp_path, backend, FakeEngines(1), FakeTransport(1), "mode=async", "colocate=false")
    await handle.run()  # the fake manager says mode=sync: the start-up fails
    status = handle.ctx.status
    assert status.state is RunState.FAILED and "rollout manager was started with mode=sync" in (
        status.error or ""
    )
    assert (status.summary or {})["state"] == "failed"
    assert backend.calls[-1] == "shutdown"


async def test_a_run_whose_end_fails_still_ends_failed(tmp_path: Path) -> None:
    backend = FakeBackend()

    def die(rollout_id: int) -> None:
        raise RuntimeError("rank died")

    async def broken() -> None:
        raise RuntimeError("the checkpoint after the fault failed")

    backend.on_train = die
    handle = _handle(tmp_path, backend, FakeEngines(1), FakeTransport(1))
    handle.controller.save_after_fault = broken  # type: ignore[method-assign]
    await handle.run()
    assert handle.ctx.status.state is RunState.FAILED and "rank died" in (handle.ctx.status.error or "")


async def test_a_failed_push_releases_the_lock_and_leaves_engines_paused(tmp_path: Path) -> None:
    engines = FakeEngines(2)
    engines.states["http://e1"].fail_update_at = 0
    handle = _handle(tmp_path, FakeBackend(), engines, FakeTransport(2))
    await handle.run()
    status = handle.ctx.status
    assert status.state is RunState.FAILED and "update_weights failed" in (status.error or "")
    rollout = handle.ops.rollout
    assert ("release_update_lock", "L0") in rollout.calls  # type: ignore[attr-defined]
    assert not any(name == "weights_loaded" for name, _ in rollout.calls)  # type: ignore[attr-defined]
    assert all(s.paused == "abort" and not s.update_active for s in engines.states.values())
    assert status.weight_version == 0 and status.steps_done == 0


async def test_a_stop_before_start_up_completes_ends_without_a_checkpoint(tmp_path: Path) -> None:
    backend = FakeBackend()
    handle = _handle(tmp_path, backend, FakeEngines(1), FakeTransport(1))
    handle.ctx.request_stop()
    await handle.run()
    assert handle.ctx.status.state is RunState.STOPPED and handle.ctx.status.checkpoint is None
    assert backend.calls == ["shutdown"] and backend.checkpoints == {}
