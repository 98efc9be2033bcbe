"""The live view of a training run: a progress bar over rollouts with the current phase, and one
line per finished step — reward, response length and ``T_step`` split by phase (seed §1).

Fed with the trainer's `RunStatus` and `RunEvent`s as they are polled; holds no state the
trainer does not report, so it can be re-attached to a running run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from vime.wire.trainer import STEP_PHASES, RunEvent, RunStatus, StepRecord, StepTimings

PHASE_LABELS = {
    "rollout": "rollout",
    "offload": "offload",
    "train": "train",
    "onload_weights": "onload_w",
    "weight_sync": "sync",
    "onload_kv": "onload_kv",
}
REWARD, REWARD_STD, LENGTH = "rollout/reward_mean", "rollout/reward_std", "rollout/response_len_mean"
"""The rollout manager's metrics of a step that its line shows."""
WARMUP_PREFIX = "sft."
"""Run events of the supervised warm-up before RL (``sft.start``, ``sft.step``, ``sft.done``)."""


def metric(metrics: Mapping[str, Any], key: str) -> float | None:
    """``metrics[key]`` when it is a number."""
    value = metrics.get(key)
    return float(value) if isinstance(value, int | float) else None


def eval_rewards(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``eval/<name>/reward_mean`` values by dataset name."""
    return {
        k.split("/")[1]: float(v)
        for k, v in metrics.items()
        if k.startswith("eval/") and k.endswith("/reward_mean") and isinstance(v, int | float)
    }


def step_line(step: StepRecord) -> str:
    """One finished step, as printed above the progress bar."""
    m = step.metrics
    reward, std, length = metric(m, REWARD), metric(m, REWARD_STD), metric(m, LENGTH)
    parts = [f"[bold]step {step.rollout_id:>3}[/]"]
    if reward is not None:
        parts.append(f"reward [bold]{reward:.3f}[/]" + (f" ± {std:.3f}" if std is not None else ""))
    if length is not None:
        parts.append(f"len {length:.1f}")
    t = step.timings
    if "async/overlap" in m:  # the async mode: waiting for a batch, training, the in-flight push
        phases = f"wait {t.rollout_s:.1f}s  train {t.train_s:.1f}s  sync {t.weight_sync_s:.1f}s"
        parts.append(f"T_step {t.step_s:.1f}s [dim]= {phases}[/]")
        parts.append(async_part(m))
    else:
        phases = "  ".join(f"{PHASE_LABELS[p]} {getattr(t, f'{p}_s'):.1f}s" for p in STEP_PHASES)
        parts.append(f"T_step {t.step_s:.1f}s [dim]= {phases}[/]")
    evals = eval_rewards(m)
    if evals:
        parts.append("eval " + " ".join(f"{n} {v:.3f}" for n, v in evals.items()))
    return "  ".join(parts)


def async_part(m: Mapping[str, Any]) -> str:
    """How much of the training ran beside generation, and the batch's staleness (async mode)."""
    text = f"overlap {100 * float(m['async/overlap']):.0f}%  stale {int(m.get('async/staleness', 0))}"
    dropped = int(m.get("async/dropped", 0))
    return text + (f"  [yellow]dropped {dropped}[/]" if dropped else "")


def steps_from_record(path: Path, first: int, before: int) -> list[StepRecord]:
    """Steps ``first <= rollout_id < before`` from the run's metrics.jsonl (flat lines, the newest
    line of a rollout id wins): the ones that finished between two polls of the run's status."""
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line while the trainer writes
        if isinstance(row, dict) and isinstance(row.get("rollout_id"), int):
            rows[row["rollout_id"]] = row
    return [
        StepRecord(
            rollout_id=rid,
            weight_version=int(row.get("weight_version", 0)),
            timings=StepTimings.from_phases({p: float(row.get(f"perf/T_{p}", 0.0)) for p in STEP_PHASES}),
            metrics={k: float(v) for k, v in row.items() if isinstance(v, int | float)},
        )
        for rid, row in sorted(rows.items())
        if first <= rid < before
    ]


class TrainProgress:
    """A rich progress bar over the run's rollouts, plus step and event lines above it."""

    def __init__(
        self, console: Console, num_rollout: int, *, verbose: bool = False, metrics_path: Path | None = None
    ) -> None:
        self.console = console
        self.verbose = verbose
        self.metrics_path = metrics_path
        """The run's metrics.jsonl, read for steps that finished between two polls."""
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("starting", total=num_rollout)
        self.warmup_task: TaskID | None = None
        self.printed_steps: set[int] = set()
        self.last_seq = -1

    def __enter__(self) -> TrainProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def note(self, text: str) -> None:
        self.progress.console.print(text, highlight=False, soft_wrap=True)

    def warmup_step(self, detail: Mapping[str, Any]) -> None:
        """Advance the warm-up bar (a second bar, shown once the first warm-up step is reported)."""
        steps, step, loss = detail.get("steps"), detail.get("step"), detail.get("loss")
        if not isinstance(steps, int) or not isinstance(step, int):
            return
        if self.warmup_task is None:
            self.warmup_task = self.progress.add_task("warm-up", total=steps)
        text = (
            f"supervised warm-up · loss {loss:.3f}" if isinstance(loss, int | float) else "supervised warm-up"
        )
        self.progress.update(self.warmup_task, completed=step + 1, total=steps, description=text)

    def update(self, status: RunStatus, events: list[RunEvent]) -> None:
        for event in events:
            if event.seq <= self.last_seq:
                continue  # `since` may repeat the last one
            self.last_seq = event.seq
            if event.action == "sft.step":
                self.warmup_step(event.detail)
            elif self.verbose or event.action.startswith(WARMUP_PREFIX):
                detail = " ".join(f"{k}={v}" for k, v in event.detail.items())
                self.note(f"[dim]{event.t:7.1f}s[/] {event.action} [dim]{detail}[/]")
        step = status.last_step
        if step is not None and step.rollout_id not in self.printed_steps:
            first = status.start_rollout_id or 0
            missed = (
                []
                if self.metrics_path is None
                else steps_from_record(self.metrics_path, first, step.rollout_id)
            )
            for st in [*missed, step]:
                if st.rollout_id not in self.printed_steps:
                    self.printed_steps.add(st.rollout_id)
                    self.note(step_line(st))
        reward = metric(step.metrics, REWARD) if step else None
        trend = f" · reward {reward:.3f}" if reward is not None else ""
        at = f"rollout {status.rollout_id}" if status.rollout_id is not None else "run"
        done = status.next_rollout_id if status.next_rollout_id is not None else status.steps_done
        self.progress.update(
            self.task,
            completed=done,  # a resumed run's bar starts at its checkpoint
            total=status.num_rollout,
            description=f"{at} · {status.phase.value}{trend}",
        )
