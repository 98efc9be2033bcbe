"""The run's record: one metrics line per step, one log line per step, TensorBoard / wandb when asked.

``runs/<run_id>/metrics.jsonl`` gets one flat JSON object per step: the rollout id, the weight
version pushed at its end, ``perf/T_<phase>`` seconds for each part of T_step and ``perf/T_step``
itself, then the rollout manager's and the trainer's metrics. A resumed run appends to the same
file, after moving the lines of the rollouts it runs again (those after its checkpoint, trained by
the leg that died, whose weights were lost with it) from metrics.jsonl and events.jsonl to
metrics.superseded.jsonl and events.superseded.jsonl (`RunRecord.supersede`): each rollout keeps
one line, the one whose weights the run went on from. The supervised warm-up's steps go to ``runs/<run_id>/warmup.jsonl`` (``sft_step``,
``sft/loss``, ...), apart, so metrics.jsonl stays one line per RL step. TensorBoard gets both
(warm-up under ``sft/`` tags on their own step axis); wandb only the RL steps (its one step axis
is the rollout id). Both are optional: asked for but not installed is a warning, not a failure.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from vime.config import RunConfig
from vime.wire.trainer import STEP_PHASES, StepRecord

log = logging.getLogger("vime.trainer.run")


def step_row(run_id: str, step: StepRecord) -> dict[str, Any]:
    """The flat metrics line of one step."""
    t = step.timings
    row: dict[str, Any] = {
        "run_id": run_id,
        "rollout_id": step.rollout_id,
        "weight_version": step.weight_version,
        "time": step.finished_at,
        "perf/T_step": t.step_s,
    }
    for phase in (*STEP_PHASES, "save", "eval"):
        row[f"perf/T_{phase}"] = getattr(t, f"{phase}_s")
    row.update(step.metrics)
    return row


def step_line(step: StepRecord) -> str:
    """``rollout 3 → v4 | T_step 12.31s = rollout 5.10 + offload 0.10 + ... | reward 0.50±0.20 len 12.0``."""
    t, m = step.timings, step.metrics
    parts = " + ".join(f"{p} {getattr(t, f'{p}_s'):.2f}" for p in STEP_PHASES)
    line = f"rollout {step.rollout_id} → v{step.weight_version} | T_step {t.step_s:.2f}s = {parts}"
    if "rollout/reward_mean" in m:
        line += f" | reward {m['rollout/reward_mean']:.3f}±{m.get('rollout/reward_std', 0.0):.3f}"
    if "rollout/response_len_mean" in m:
        line += f" len {m['rollout/response_len_mean']:.1f}"
    if "train/loss" in m:
        line += f" loss {m['train/loss']:.4f}"
    if "async/overlap" in m:
        line += f" | overlap {m['async/overlap']:.2f} stale {int(m.get('async/staleness', 0))}"
        line += f" dropped {int(m.get('async/dropped', 0))}"
    return line


class RunRecord:
    """Where one run's per-step record goes."""

    def __init__(self, cfg: RunConfig, run_id: str) -> None:
        self.run_id = run_id
        self.dir = Path(cfg.output_dir) / run_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.events_path = self.dir / "events.jsonl"
        self.warmup_path = self.dir / "warmup.jsonl"
        self.report_path = self.dir / "report.png"
        self._tb: Any = _tensorboard(self.dir / "tensorboard") if cfg.log_tensorboard else None
        self._wandb: Any = _wandb(cfg, run_id) if cfg.log_wandb else None

    def step(self, step: StepRecord) -> dict[str, Any]:
        row = step_row(self.run_id, step)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        log.info("%s", step_line(step))
        scalars = {
            k: v for k, v in row.items() if isinstance(v, int | float) and k not in ("rollout_id", "time")
        }
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step.rollout_id)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step.rollout_id)
        return row

    def warmup_step(self, step: int, metrics: dict[str, float]) -> dict[str, Any]:
        """One supervised warm-up step's line in warmup.jsonl (and TensorBoard)."""
        row: dict[str, Any] = {"run_id": self.run_id, "sft_step": step, "time": time.time(), **metrics}
        with self.warmup_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        log.info("warm-up step %d: loss %.4f", step, metrics.get("sft/loss", float("nan")))
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        return row

    def supersede(self, first: int) -> int:
        """Move the lines of rollout ``first`` and later from metrics.jsonl and events.jsonl to their
        ``*.superseded.jsonl`` files (a run that starts at ``first`` makes them again); returns the
        metrics lines moved."""
        moved = 0
        for path in (self.metrics_path, self.events_path):
            kept, gone = _split_from(path, first)
            if gone:
                with path.with_suffix(".superseded.jsonl").open("a") as f:
                    f.writelines(gone)
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text("".join(kept))
                tmp.replace(path)
                log.info("%s: %d line(s) of rollouts >= %d superseded", path.name, len(gone), first)
            if path == self.metrics_path:
                moved = len(gone)
        return moved

    def rows(self) -> list[dict[str, Any]]:
        """Every step of this run id, the newest line winning for a rollout id seen twice."""
        return _newest_by(self.metrics_path, "rollout_id")

    def warmup_rows(self) -> list[dict[str, Any]]:
        """Every warm-up step of this run id (the newest line winning for a step seen twice)."""
        return _newest_by(self.warmup_path, "sft_step")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _split_from(path: Path, first: int) -> tuple[list[str], list[str]]:
    """The lines of a JSONL record kept and those of rollout ``first`` or later (``rollout_id``),
    with any line torn by the crash; lines with no rollout id (a run's start-up events) are kept."""
    if not path.exists():
        return [], []
    kept: list[str] = []
    gone: list[str] = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            row = json.loads(line)
        except ValueError:
            gone.append(line if line.endswith("\n") else line + "\n")
            continue
        rollout_id = row.get("rollout_id") if isinstance(row, dict) else None
        (gone if isinstance(rollout_id, int) and rollout_id >= first else kept).append(line)
    return kept, gone


def _newest_by(path: Path, key: str) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` by ``key``, the newest line of each, in key order."""
    if not path.exists():
        return []
    by_key: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_key[int(row[key])] = row
    return [by_key[k] for k in sorted(by_key)]


def _tensorboard(path: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("log_tensorboard is set but tensorboard is not installed (pip install tensorboard)")
        return None
    return SummaryWriter(str(path))


def _wandb(cfg: RunConfig, run_id: str) -> Any:
    try:
        import wandb
    except ImportError:
        log.warning("log_wandb is set but wandb is not installed (pip install wandb)")
        return None
    return wandb.init(
        project="vime", name=run_id, id=run_id, resume="allow", config=cfg.model_dump(mode="json")
    )
