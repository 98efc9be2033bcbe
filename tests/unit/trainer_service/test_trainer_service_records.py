"""The run's record (metrics.jsonl, the per-step log line, report.png, the summary) and the small
pieces of run set-up: config overrides from a request, per-run checkpoint directories, the run id,
which transport ``auto`` picks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from vime_trainer.record import RunRecord, step_line
from vime_trainer.report import draw_report, summarize, warmup_summary
from vime_trainer.runs import first_rollout, override_pairs, run_config

from vime.config import RunConfig, load_config
from vime.service import ServiceError
from vime.wire.trainer import RunRequest, StepRecord, StepTimings

BASE = ["rollout_num_gpus=0", "actor_num_gpus_per_node=0", "tensor_model_parallel_size=1"]


def _step(rollout_id: int, version: int, reward: float, seconds: float) -> StepRecord:
    phases = {
        "rollout": seconds,
        "offload": 0.1,
        "train": 2 * seconds,
        "onload_weights": 0.05,
        "weight_sync": 0.5,
        "onload_kv": 0.05,
        "save": 1.0,
    }
    return StepRecord(
        rollout_id=rollout_id,
        weight_version=version,
        timings=StepTimings.from_phases(phases),
        metrics={
            "rollout/reward_mean": reward,
            "rollout/reward_std": 0.2,
            "rollout/response_len_mean": 10.0 + rollout_id,
            "train/loss": 0.1,
        },
        finished_at=1000.0 + rollout_id,
    )


def test_t_step_is_the_sum_of_the_six_phases_and_save_is_not_in_it() -> None:
    t = _step(0, 2, 0.5, 1.0).timings
    assert t.step_s == pytest.approx(1.0 + 0.1 + 2.0 + 0.05 + 0.5 + 0.05)
    assert t.save_s == 1.0


def test_metrics_lines_log_line_report_and_summary(tmp_path: Path) -> None:
    cfg = load_config(overrides=[*BASE, f"output_dir={tmp_path}"], environ={})
    record = RunRecord(cfg, "r1")
    for i, (v, reward) in enumerate([(2, 0.1), (3, 0.3), (4, 0.6)]):
        record.step(_step(i, v, reward, 1.0 + i))
    record.step(_step(2, 4, 0.7, 3.0))  # a resumed leg redoing rollout 2: the newest line wins
    lines = [json.loads(x) for x in (tmp_path / "r1" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and lines[0]["perf/T_step"] == pytest.approx(3.7)
    assert {
        "perf/T_rollout",
        "perf/T_offload",
        "perf/T_train",
        "perf/T_onload_weights",
        "perf/T_weight_sync",
        "perf/T_onload_kv",
        "perf/T_save",
    } <= set(lines[0])
    rows = record.rows()
    assert [r["rollout_id"] for r in rows] == [0, 1, 2] and rows[2]["rollout/reward_mean"] == 0.7
    s = summarize(rows)
    assert (s["steps"], s["first_rollout_id"], s["last_rollout_id"], s["weight_version"]) == (3, 0, 2, 4)
    assert s["reward_mean_first"] == 0.1 and s["reward_mean_last"] == 0.7
    assert s["phase_mean_s"]["train"] == pytest.approx((2 + 4 + 6) / 3)
    assert sum(s["phase_share"].values()) == pytest.approx(1.0, abs=1e-3)
    png = draw_report(rows, record.report_path, "r1")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert draw_report([], tmp_path / "none.png", "x") is None and summarize([]) == {"steps": 0}
    line = step_line(_step(3, 5, 0.25, 1.0))
    assert line.startswith("rollout 3 → v5 | T_step 3.70s = rollout 1.00 + offload 0.10 + train 2.00")
    assert "reward 0.250±0.200" in line and "len 13.0" in line


def test_warm_up_steps_have_their_own_record_and_summary(tmp_path: Path) -> None:
    cfg = load_config(overrides=[*BASE, f"output_dir={tmp_path}"], environ={})
    record = RunRecord(cfg, "w1")
    for step, loss in enumerate([4.0, 3.0, 2.5]):
        record.warmup_step(step, {"sft/loss": loss, "sft/grad_norm": 1.0})
    record.warmup_step(2, {"sft/loss": 2.25})  # a fresh restart redoing step 2: the newest line wins
    record.step(_step(0, 2, 0.1, 1.0))
    assert [r["sft_step"] for r in record.warmup_rows()] == [0, 1, 2]
    assert [r["rollout_id"] for r in record.rows()] == [0]  # metrics.jsonl: RL steps only
    lines = (tmp_path / "w1" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and "sft/loss" not in json.loads(lines[0])
    assert warmup_summary(record.warmup_rows()) == {
        "sft_steps": 3,
        "sft_loss_first": 4.0,
        "sft_loss_last": 2.25,
    }
    assert warmup_summary([]) == {}


def test_request_config_goes_on_top_of_the_service_config(tmp_path: Path) -> None:
    pairs = list(override_pairs({"num_rollout": 3, "trainer": {"lr": 1e-4, "weight_dir": None}, "data": {}}))
    assert pairs == ["num_rollout=3", "trainer.lr=0.0001", "trainer.weight_dir=null", "data={}"]
    base = [*BASE, "services.redis_url=redis://r:6379/0", f"trainer.checkpoint_dir={tmp_path}"]

    def load(extra: list[str]) -> object:
        return load_config(None, [*base, *extra], environ={})

    cfg = run_config(load, RunRequest(run_id="exp1", config={"num_rollout": 3, "eps_clip": 0.3}))  # type: ignore[arg-type]
    assert cfg.run_id == "exp1" and cfg.num_rollout == 3
    assert cfg.eps_clip_high == 0.3  # derived values are derived again from the merged config
    assert cfg.offload_train  # the colocated synchronous default; a run may keep its state on the GPU
    assert not run_config(load, RunRequest(config={"offload_train": False})).offload_train  # type: ignore[arg-type]
    assert cfg.trainer.checkpoint_dir == str(tmp_path / "exp1")
    with pytest.raises(ServiceError) as err:
        run_config(load, RunRequest(config={"rollout_batch_size": -1}))  # type: ignore[arg-type]
    assert err.value.status_code == 422 and "rollout_batch_size" in err.value.message
    with pytest.raises(ServiceError, match="redis_url"):
        run_config(lambda extra: load_config(None, [*BASE, *extra], environ={}), RunRequest())


def test_run_id_from_the_request_the_config_the_environment_or_a_timestamp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = [*BASE, "services.redis_url=redis://r:6379/0", f"trainer.checkpoint_dir={tmp_path}"]

    def load(extra: list[str]) -> RunConfig:
        return load_config(None, [*base, *extra], environ={})

    monkeypatch.delenv("VIME_RUN_ID", raising=False)
    assert re.fullmatch(r"run-\d{8}-\d{6}", run_config(load, RunRequest()).run_id or "")
    monkeypatch.setenv("VIME_RUN_ID", "from-env")  # what the rollout manager names its stream with
    cfg = run_config(load, RunRequest())
    assert cfg.run_id == "from-env" and cfg.trainer.checkpoint_dir == str(tmp_path / "from-env")
    assert run_config(load, RunRequest(config={"run_id": "cfg"})).run_id == "cfg"
    assert run_config(load, RunRequest(run_id="req", config={"run_id": "cfg"})).run_id == "req"


def test_tensorboard_asked_for_but_missing_is_a_warning_not_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("torch")
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensorboard is installed here: nothing to warn about")
    cfg = load_config(overrides=[*BASE, f"output_dir={tmp_path}", "log_tensorboard=true"], environ={})
    with caplog.at_level("WARNING"):
        record = RunRecord(cfg, "tb")
        record.step(_step(0, 2, 0.5, 1.0))
    assert "tensorboard is not installed" in caplog.text
    assert len(record.rows()) == 1


def test_a_resumed_run_supersedes_the_lines_of_the_rollouts_it_runs_again(tmp_path: Path) -> None:
    """Rollouts 0-4 were recorded, the checkpoint is of rollout 2: 3 and 4 are run again, so their
    old metrics and events lines move aside, and a line torn by the crash goes with them."""
    cfg = load_config(overrides=[*BASE, f"output_dir={tmp_path}"], environ={})
    record = RunRecord(cfg, "r")
    for k in range(5):
        record.step(_step(k, k + 1, 0.1 * k, 1.0))
    events = [{"seq": 0, "rollout_id": None, "action": "run.start"}]
    events += [{"seq": k + 1, "rollout_id": k, "action": "step.done"} for k in range(5)]
    record.events_path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"seq": 6, "rol')
    assert record.supersede(3) == 2
    assert [r["rollout_id"] for r in record.rows()] == [0, 1, 2]
    kept = [json.loads(x) for x in record.events_path.read_text().splitlines()]
    assert [e["rollout_id"] for e in kept] == [None, 0, 1, 2]  # start-up events stay
    aside = (tmp_path / "r" / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(x)["rollout_id"] for x in aside] == [3, 4]
    gone = (tmp_path / "r" / "events.superseded.jsonl").read_text().splitlines()
    assert len(gone) == 3 and gone[-1] == '{"seq": 6, "rol'
    record.step(_step(3, 4, 0.9, 1.0))  # the resumed leg's rollout 3
    assert [(r["rollout_id"], r["rollout/reward_mean"]) for r in record.rows()][-1] == (3, 0.9)
    assert len(record.metrics_path.read_text().splitlines()) == 4
    assert RunRecord(cfg, "new").supersede(0) == 0  # a new run id: nothing to move


def test_a_run_starts_after_the_newest_checkpoint_of_its_run_id(tmp_path: Path) -> None:
    cfg = load_config(overrides=[*BASE, f"trainer.checkpoint_dir={tmp_path}"], environ={})
    assert first_rollout(cfg, resume=False) == 0
    with pytest.raises(ServiceError) as err:
        first_rollout(cfg, resume=True)
    assert err.value.status_code == 409
    for k, complete in ((1, True), (3, True), (4, False)):  # rollout 4's save was cut short
        d = tmp_path / f"rollout_{k:07d}"
        d.mkdir()
        if complete:
            (d / "vime_state.json").write_text(json.dumps({"rollout_id": k, "next_rollout_id": k + 1}))
    assert first_rollout(cfg, resume=True) == 4
    assert first_rollout(cfg.model_copy(update={"start_rollout_id": 2}), resume=False) == 2
