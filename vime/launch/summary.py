"""The summary printed when ``vime train`` ends: did the reward rise, how long did a step take,
and where the records are (``metrics.jsonl``, ``report.png``, logs).

Computed from the run's ``metrics.jsonl`` (one flat line per finished step, written by the trainer),
so it shows every step even if the live view missed one between two polls.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from vime.launch.progress import LENGTH, REWARD, eval_rewards, metric
from vime.wire.trainer import STEP_PHASES, RunStatus


@dataclass
class StepRow:
    rollout_id: int
    metrics: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)


def read_steps(path: Path) -> list[StepRow]:
    """Steps of the trainer's metrics.jsonl: flat lines with ``rollout_id``, ``perf/T_<phase>``
    seconds and the rollout's and trainer's metrics (``rollout/reward_mean``, ...). A rollout id
    seen twice (a resumed run) keeps its newest line; a torn last line is skipped."""
    by_rollout: dict[int, StepRow] = {}
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("rollout_id"), int):
            continue
        timings = {f"{p}_s": float(rec.get(f"perf/T_{p}", 0.0)) for p in (*STEP_PHASES, "step")}
        by_rollout[rec["rollout_id"]] = StepRow(rec["rollout_id"], rec, timings)
    return [by_rollout[k] for k in sorted(by_rollout)]


@dataclass
class Summary:
    steps: int
    reward_start: float | None
    reward_end: float | None
    window: int
    """Steps averaged at each end (a quarter of the run, at least 1)."""
    length_start: float | None
    length_end: float | None
    eval_start: dict[str, float]
    eval_end: dict[str, float]
    step_s: dict[str, float]
    """Mean seconds per phase, and ``step`` for T_step."""

    @property
    def reward_gain(self) -> float | None:
        if self.reward_start is None or self.reward_end is None:
            return None
        return self.reward_end - self.reward_start


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize(rows: list[StepRow]) -> Summary:
    """Start vs end (mean of the first and last quarter of the steps), and mean phase times."""
    k = max(1, len(rows) // 4)
    head, tail = rows[:k], rows[-k:]
    rewards = [metric(r.metrics, REWARD) for r in rows]
    lengths = [metric(r.metrics, LENGTH) for r in rows]
    evals = [eval_rewards(r.metrics) for r in rows if eval_rewards(r.metrics)]
    step_s = {p: _mean([r.timings.get(f"{p}_s") for r in rows]) or 0.0 for p in (*STEP_PHASES, "step")}
    return Summary(
        steps=len(rows),
        reward_start=_mean(rewards[:k]) if head else None,
        reward_end=_mean(rewards[-k:]) if tail else None,
        window=k,
        length_start=_mean(lengths[:k]) if head else None,
        length_end=_mean(lengths[-k:]) if tail else None,
        eval_start=evals[0] if evals else {},
        eval_end=evals[-1] if evals else {},
        step_s=step_s,
    )


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_summary(status: RunStatus | None, run_dir: Path, console: Console) -> Summary:
    """The final table; returns the numbers for callers (and tests)."""
    s = summarize(read_steps(run_dir / "metrics.jsonl"))
    state = status.state.value if status else "unknown"
    table = Table(title=f"run {run_dir.name}: {state}, {s.steps} steps", show_header=True)
    table.add_column("")
    table.add_column(f"start (first {s.window})", justify="right")
    table.add_column(f"end (last {s.window})", justify="right")
    table.add_row("reward mean", _fmt(s.reward_start), _fmt(s.reward_end))
    table.add_row("response length", _fmt(s.length_start, ".1f"), _fmt(s.length_end, ".1f"))
    for name in s.eval_end:
        table.add_row(f"eval {name}", _fmt(s.eval_start.get(name)), _fmt(s.eval_end.get(name)))
    console.print(table)
    if s.reward_gain is not None:
        colour = "green" if s.reward_gain > 0 else "yellow"
        console.print(
            f"reward {_fmt(s.reward_start)} → {_fmt(s.reward_end)} ([{colour}]{s.reward_gain:+.3f}[/])"
        )
    phases = "  ".join(f"{p} {s.step_s[p]:.1f}s" for p in STEP_PHASES)
    console.print(f"mean T_step {s.step_s['step']:.1f}s = {phases}", highlight=False, soft_wrap=True)
    if status is not None and status.error:
        console.print(f"[red]error: {status.error}[/]", highlight=False)
    for name in ("metrics.jsonl", "report.png"):
        path = run_dir / name
        console.print(
            f"{name:<14} {path}" + ("" if path.exists() else "  [red](missing)[/]"), highlight=False
        )
    console.print(f"{'logs':<14} {run_dir / 'logs'}/", highlight=False)
    return s
