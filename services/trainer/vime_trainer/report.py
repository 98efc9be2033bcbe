"""The run's final report: ``report.png`` (reward, response length and T_step stacked by phase, per
step) and the summary dict the CLI prints.

Drawn from ``metrics.jsonl`` (every step of the run id, resumed legs included) with matplotlib's
Agg backend, so it works on a headless host.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from vime.wire.trainer import STEP_PHASES


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals and means over the steps: T_step and its parts, first/last reward, final version."""
    if not rows:
        return {"steps": 0}
    t_step = [float(r["perf/T_step"]) for r in rows]
    phase_mean = {p: statistics.fmean(float(r.get(f"perf/T_{p}", 0.0)) for r in rows) for p in STEP_PHASES}
    total = sum(phase_mean.values()) or 1.0
    out: dict[str, Any] = {
        "steps": len(rows),
        "first_rollout_id": int(rows[0]["rollout_id"]),
        "last_rollout_id": int(rows[-1]["rollout_id"]),
        "weight_version": int(rows[-1]["weight_version"]),
        "T_step_mean_s": round(statistics.fmean(t_step), 4),
        "T_step_total_s": round(sum(t_step), 4),
        "phase_mean_s": {p: round(v, 4) for p, v in phase_mean.items()},
        "phase_share": {p: round(v / total, 4) for p, v in phase_mean.items()},
    }
    for key, name in (
        ("rollout/reward_mean", "reward_mean"),
        ("rollout/response_len_mean", "response_len_mean"),
    ):
        values = [float(r[key]) for r in rows if key in r]
        if values:
            out[f"{name}_first"], out[f"{name}_last"] = round(values[0], 4), round(values[-1], 4)
    return out


def warmup_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The supervised warm-up in the summary: its steps and its first and last loss."""
    losses = [float(r["sft/loss"]) for r in rows if "sft/loss" in r]
    if not losses:
        return {}
    return {
        "sft_steps": len(rows),
        "sft_loss_first": round(losses[0], 4),
        "sft_loss_last": round(losses[-1], 4),
    }


def draw_report(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Three panels per step: reward mean ± std, response length, T_step stacked by phase."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = [int(r["rollout_id"]) for r in rows]
    fig, (ax_r, ax_l, ax_t) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    mean = [float(r.get("rollout/reward_mean", float("nan"))) for r in rows]
    std = [float(r.get("rollout/reward_std", 0.0)) for r in rows]
    ax_r.plot(x, mean, marker="o", label="reward mean")
    ax_r.fill_between(
        x,
        [m - s for m, s in zip(mean, std, strict=True)],
        [m + s for m, s in zip(mean, std, strict=True)],
        alpha=0.25,
        label="± std",
    )
    ax_r.set_ylabel("reward")
    ax_r.legend(loc="best")
    ax_l.plot(x, [float(r.get("rollout/response_len_mean", float("nan"))) for r in rows], marker="o")
    ax_l.set_ylabel("response length (tokens)")
    bottom = [0.0] * len(rows)
    for phase in STEP_PHASES:
        values = [float(r.get(f"perf/T_{phase}", 0.0)) for r in rows]
        ax_t.bar(x, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax_t.set_ylabel("T_step (s)")
    ax_t.set_xlabel("rollout id")
    ax_t.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_t.legend(loc="best", fontsize="small", ncol=3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
