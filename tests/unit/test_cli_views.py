"""What `vime up` / `vime train` show: the filtered log view, the per-step line, the summary read
from the trainer's metrics.jsonl, and Ctrl-C handling (first asks, second hurries)."""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path

from rich.console import Console

from vime.launch.logs import LineFilter, LogFollower, _Followed
from vime.launch.progress import TrainProgress, step_line
from vime.launch.signals import latched_signals
from vime.launch.summary import print_summary, read_steps, summarize
from vime.wire.trainer import RunEvent, RunPhase, RunState, RunStatus, StepRecord, StepTimings


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, color_system=None), buf


def test_console_shows_warnings_errors_and_whole_tracebacks_only() -> None:
    filt, state = LineFilter(verbose=False), _Followed(Path("x.log"))
    lines = [
        ("2026 vime.rollout INFO starting 1 reference engine(s)", False),
        ("2026 vime.router WARNING engine admitted", True),
        ("Traceback (most recent call last):", True),
        ('  File "x.py", line 1, in <module>', True),
        ("    raise ValueError('bad')", True),
        ("ValueError: bad", True),
        ("INFO:     Application startup complete.", False),
        ("12345:M 29 Nov # WARNING Memory overcommit must be enabled!", False),
    ]
    assert [filt.keep(state, line) for line, _ in lines] == [want for _, want in lines]
    verbose = LineFilter(verbose=True)
    assert all(verbose.keep(_Followed(Path("x.log")), line) for line, _ in lines)


def test_follower_prefixes_new_lines_holds_partial_ones_and_strips_colour(tmp_path: Path) -> None:
    console, buf = _console()
    old = tmp_path / "reward.log"
    old.write_text("old ERROR from a previous stack\n")
    follower = LogFollower([tmp_path], console, verbose=True)
    follower.start()
    follower.stop()  # stop only polls once more; drive polls by hand below
    with old.open("a") as f:
        f.write("\x1b[33m WARN\x1b[0m first\nsecond without newl")
    follower.poll()
    with old.open("a") as f:
        f.write("ine\n")
    (tmp_path / "engine0.log").write_text("engine says hi\n")
    follower.poll()
    out = buf.getvalue().splitlines()
    assert out == [
        "      reward │  WARN first",
        "     engine0 │ engine says hi",  # files in name order within one poll
        "      reward │ second without newline",
    ]


def _step(rid: int, reward: float, length: float = 5.0) -> StepRecord:
    timings = StepTimings.from_phases({"rollout": 2.0, "offload": 0.5, "train": 3.0, "weight_sync": 0.5})
    return StepRecord(
        rollout_id=rid,
        weight_version=rid + 2,
        timings=timings,
        metrics={
            "rollout/reward_mean": reward,
            "rollout/reward_std": 0.25,
            "rollout/response_len_mean": length,
        },
    )


def test_step_line_shows_reward_length_and_t_step_by_phase() -> None:
    line = step_line(_step(3, 0.5))
    assert "step   3" in line and "reward [bold]0.500[/] ± 0.250" in line and "len 5.0" in line
    assert "T_step 6.0s" in line
    for part in (
        "rollout 2.0s",
        "offload 0.5s",
        "train 3.0s",
        "onload_w 0.0s",
        "sync 0.5s",
        "onload_kv 0.0s",
    ):
        assert part in line


def test_an_async_step_shows_its_wait_train_sync_overlap_and_staleness() -> None:
    step = _step(4, 0.5)
    step.metrics.update({"async/overlap": 0.93, "async/staleness": 1.0, "async/dropped": 2.0})
    line = step_line(step)
    assert "wait 2.0s  train 3.0s  sync 0.5s" in line and "offload" not in line
    assert "overlap 93%  stale 1" in line and "dropped 2" in line
    step.metrics["async/dropped"] = 0.0
    assert "dropped" not in step_line(step)


def _write_metrics(path: Path, steps: list[StepRecord]) -> None:
    # The trainer's flat line format (vime_trainer.record.step_row).
    with path.open("a") as f:
        for st in steps:
            row = {"run_id": "r", "rollout_id": st.rollout_id, "weight_version": st.weight_version}
            row["perf/T_step"] = st.timings.step_s
            for phase in ("rollout", "offload", "train", "onload_weights", "weight_sync", "onload_kv"):
                row[f"perf/T_{phase}"] = getattr(st.timings, f"{phase}_s")
            row.update(st.metrics)
            f.write(json.dumps(row) + "\n")


def test_summary_compares_first_and_last_quarter(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_metrics(path, [_step(i, 0.1 * i, 10.0 - i) for i in range(8)])
    with path.open("a") as f:
        f.write('{"rollout_id": 8, "perf/T_st')  # torn last line while the trainer writes
    s = summarize(read_steps(path))
    assert s.steps == 8 and s.window == 2
    assert abs(s.reward_start - 0.05) < 1e-9 and abs(s.reward_end - 0.65) < 1e-9
    assert abs(s.reward_gain - 0.6) < 1e-9
    assert s.length_start == 9.5 and s.length_end == 3.5
    assert s.step_s["step"] == 6.0 and s.step_s["train"] == 3.0 and s.step_s["onload_kv"] == 0.0


def test_resumed_rollout_keeps_its_newest_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_metrics(path, [_step(0, 0.0), _step(1, 0.2), _step(1, 0.4), _step(2, 0.6)])
    rows = read_steps(path)
    assert [r.rollout_id for r in rows] == [0, 1, 2]
    assert rows[1].metrics["rollout/reward_mean"] == 0.4


def test_printed_summary_shows_start_end_and_missing_records(tmp_path: Path) -> None:
    _write_metrics(tmp_path / "metrics.jsonl", [_step(i, r) for i, r in enumerate([0.1, 0.2, 0.5, 0.7])])
    console, buf = _console()
    print_summary(None, tmp_path, console)
    out = buf.getvalue()
    assert "reward 0.100 → 0.700 (+0.600)" in out
    assert "mean T_step 6.0s" in out
    assert "report.png" in out and "(missing)" in out  # no report drawn in this directory


def test_first_signal_asks_second_hurries_and_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGINT)
    with latched_signals() as latch:
        assert not latch.fired and not latch.wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        assert latch.wait(1.0) and latch.fired and not latch.hurry
        os.kill(os.getpid(), signal.SIGINT)
        latch.wait(1.0)
        assert latch.hurry
        assert latch.exit_code() == 128 + signal.SIGTERM  # the first signal names the exit
    assert signal.getsignal(signal.SIGINT) is before


def test_warmup_events_drive_their_own_bar_and_each_step_prints_once() -> None:
    console, buf = _console()
    view = TrainProgress(console, 3)
    status = RunStatus(run_id="r", state=RunState.RUNNING, phase=RunPhase.WARMUP, num_rollout=3)
    events = [
        RunEvent(seq=0, t=0.1, rollout_id=None, action="sft.start", detail={"steps": 2}),
        RunEvent(
            seq=1, t=0.5, rollout_id=None, action="sft.step", detail={"step": 0, "steps": 2, "loss": 1.5}
        ),
        RunEvent(
            seq=2, t=0.9, rollout_id=None, action="sft.step", detail={"step": 1, "steps": 2, "loss": 0.9}
        ),
        RunEvent(seq=3, t=1.0, rollout_id=None, action="engines.onload", detail={}),
    ]
    view.update(status, events)
    view.update(status, events[-2:])  # `since` repeats what was seen: ignored
    assert view.warmup_task is not None
    bar = view.progress.tasks[view.warmup_task]
    assert (bar.completed, bar.total) == (2, 2) and "loss 0.900" in bar.description
    out = buf.getvalue()
    assert "sft.start" in out and "sft.step" not in out  # one bar, not a line per step
    assert "engines.onload" not in out  # other events only with --verbose
    done = status.model_copy(update={"phase": RunPhase.ROLLOUT, "steps_done": 1, "last_step": _step(0, 0.5)})
    view.update(done, [])
    view.update(done, [])
    assert buf.getvalue().count("step   0") == 1
    assert view.progress.tasks[view.task].completed == 1


def test_steps_finished_between_two_polls_are_printed_from_the_record(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_metrics(path, [_step(i, 0.1 * i) for i in range(5)])
    console, buf = _console()
    view = TrainProgress(console, 8, metrics_path=path)
    status = RunStatus(run_id="r", state=RunState.RUNNING, phase=RunPhase.ROLLOUT, num_rollout=8)
    view.update(
        status.model_copy(update={"steps_done": 1, "last_step": _step(0, 0.0), "start_rollout_id": 0}), []
    )
    # Steps 1-3 finished before the next poll, which only sees step 4.
    view.update(
        status.model_copy(update={"steps_done": 5, "last_step": _step(4, 0.4), "start_rollout_id": 0}), []
    )
    lines = [line for line in buf.getvalue().splitlines() if line.startswith("step")]
    assert [line.split()[1] for line in lines] == ["0", "1", "2", "3", "4"]
    assert "reward 0.300" in lines[3]
