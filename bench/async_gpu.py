"""The async mode against the synchronous one on the same GPU, back to back: samples trained per
second, and the train/inference mismatch of each.

Each mode gets its own stack (the rollout manager reads ``mode`` at start), built from the config
of ``bench/step_gpu.py`` (one real vLLM engine and the Megatron trainer on one GPU, a random model
of a Qwen3 shape, ``--prompts`` × ``--n`` samples of up to ``--response-len`` tokens), with rollout
log-probs requested so both report the mismatch metrics. ``sync``: colocated, vLLM and Megatron
sleep in turn (``engine.gpu_memory_utilization`` ``--sync-engine-mem``). ``async``: both stay
awake and split the GPU (``--engine-mem`` + ``--trainer-mem`` ≤ 1), the producer generates while
the trainer trains, each push reaches vLLM in flight (``inflight_update: keep``). A run of
``--rollouts`` steps per mode; the first step pays warm-ups, so throughput is taken between the
ends of the later steps:

    samples/s = samples per step × (k − 1) / (end of step k − end of step 1 − checkpoint saves between)

(the run's last step always saves a checkpoint — 17 s for the 0.6B shape on the H200 — which is
not the mode's throughput).

Each mode's result is kept in ``--results`` (default ``WORK/results.json``) and a run of one mode
is compared with the other's kept result, so the two modes can run as two calls on one machine:
each stack's vLLM start takes 2–2.5 min, and both modes in one call did not fit a 10-minute limit
on an H100 (12-06).

The summary gives both, their ratio (goal ≥ 1.5), and per mode the medians of the mismatch
(|Δ log p|, the ratio's mean and max, the fractions TIS would truncate / MIS would drop), of
``T_step`` and its parts, and (async) of the overlap and the staleness.

    python bench/async_gpu.py --engine vllm --size qwen3-0.6b --prompts 32 --n 8 --response-len 1024 --rollouts 5
    python bench/async_gpu.py --engine reference --size micro --prompts 4 --n 4 --response-len 16 --rollouts 3  # CPU
    python bench/async_gpu.py --modes sync --results R.json ...; python bench/async_gpu.py --modes async --results R.json ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_common import bench_model, console, emit
from rich.table import Table
from step_gpu import TOKEN, RunSpec, run_config

from vime.clients.trainer import TrainerClient
from vime.config import load_config
from vime.launch.signals import SignalLatch
from vime.launch.stack import plan_stack
from vime.launch.supervisor import Supervisor
from vime.models.tiny import QWEN3_SHAPES, SHAPES

MISMATCH = (
    "train/mismatch_mean_abs",
    "train/mismatch_ratio_mean",
    "train/mismatch_ratio_max",
    "train/mismatch_tis_clipfrac",
    "train/mismatch_mis_maskfrac",
)
PARTS = (
    "perf/T_step",
    "perf/T_rollout",
    "perf/T_train",
    "perf/T_weight_sync",
    "async/overlap",
    "async/staleness",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["vllm", "reference"], default="vllm")
    p.add_argument("--size", default="qwen3-0.6b", choices=[*SHAPES, *QWEN3_SHAPES])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--rollouts", type=int, default=5, help="steps per mode (the first is a warm-up)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    p.add_argument("--sync-engine-mem", type=float, default=0.5, help="sync: engine.gpu_memory_utilization")
    # On an H100 (79 GiB) 0.45 / 0.45 ran the trainer out of memory in its second step at 16k
    # budgets (34.4 GiB allocated of 35.6: the 31.3 GiB step peak + the push's 1.5 GB staging
    # buffers, which stay allocated when nothing sleeps); vLLM's process took 38.4 GiB at 0.45.
    p.add_argument("--engine-mem", type=float, default=0.4, help="async: engine.gpu_memory_utilization")
    p.add_argument("--trainer-mem", type=float, default=0.5, help="async: trainer.gpu_memory_utilization")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs (faster start)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--results", type=Path, default=None, help="each mode's result, kept across calls")
    return p.parse_args()


def mode_config(work: Path, args: argparse.Namespace, model: Path, mode: str) -> dict[str, Any]:
    """step_gpu's stack for one mode, log-probs requested (mismatch metrics), no eval."""
    step_args = argparse.Namespace(
        engine=args.engine,
        size=args.size,
        prompts=args.prompts,
        n=args.n,
        response_len=args.response_len,
        rollouts=args.rollouts,
        micro_batch=args.micro_batch,
        gpu_memory_utilization=args.sync_engine_mem if mode == "sync" else args.engine_mem,
        enforce_eager=args.enforce_eager,
        logprobs=True,
        runs=[RunSpec.parse("vllm")],
    )
    (work / mode).mkdir(parents=True, exist_ok=True)
    cfg = run_config(work / mode, step_args, model)
    cfg["run_id"] = f"bench-{mode}"
    cfg["mode"] = mode
    if mode == "async" and args.engine == "vllm":
        cfg["trainer"]["gpu_memory_utilization"] = args.trainer_mem
    return cfg


def run_mode(work: Path, args: argparse.Namespace, model: Path, mode: str) -> dict[str, Any]:
    plan = plan_stack(
        load_config(base=mode_config(work, args, model, mode), overrides=args.overrides, environ={})
    )
    sup = Supervisor(plan, console, SignalLatch())
    out: dict[str, Any] = {"mode": mode}
    try:
        t0 = time.monotonic()
        sup.start()
        out["stack_start_s"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        status = asyncio.run(_run(plan.cfg.services.url("trainer"), plan.run_id))
        out |= {"run_s": round(time.monotonic() - t0, 1), "state": str(status.state), "error": status.error}
    except Exception as exc:  # reported; the other mode still runs
        out |= {"state": "failed", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        sup.stop()
    metrics = plan.run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    return out | summarize(rows, args.prompts * args.n)


async def _run(trainer_url: str, run_id: str) -> Any:
    async with TrainerClient(trainer_url, token=TOKEN, timeout=60) as client:
        await client.start_run(run_id=run_id)
        return await client.wait_run(run_id, timeout_s=3000, poll_s=1.0)


def summarize(rows: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """Throughput between the ends of the steady steps, medians of the mismatch and the step parts."""
    steady = rows[1:]
    out: dict[str, Any] = {"steps": len(rows)}
    if len(steady) >= 2:
        saves = sum(float(r.get("perf/T_save", 0.0)) for r in steady[1:])
        span = steady[-1]["time"] - steady[0]["time"] - saves
        out["samples_per_s"] = round(samples * (len(steady) - 1) / span, 3) if span > 0 else None
        tokens = [r.get("rollout/generated_tokens", 0.0) for r in steady[1:]]
        out["generated_tokens_per_s"] = round(sum(tokens) / span) if span > 0 else None
    for key in (*MISMATCH, *PARTS):
        values = [float(r[key]) for r in steady if key in r]
        if values:
            out[key] = round(statistics.median(values), 5)
    out["dropped"] = max((int(r.get("async/dropped_total", 0)) for r in rows), default=0)
    return out


def report(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    table = Table(title="async vs sync on one GPU (medians of the steady steps)")
    table.add_column("")
    for mode in results:
        table.add_column(mode, justify="right")
    for key in ("samples_per_s", "generated_tokens_per_s", *PARTS, *MISMATCH, "dropped", "state"):
        table.add_row(key, *(str(results[m].get(key, "-")) for m in results))
    console.print(table)
    out: dict[str, Any] = {"modes": results}
    sync, fast = results.get("sync", {}).get("samples_per_s"), results.get("async", {}).get("samples_per_s")
    if sync and fast:
        out["async_over_sync"] = round(fast / sync, 3)
        console.print(f"async / sync samples per second: {out['async_over_sync']} (goal >= 1.5)")
    return out


def _read(path: Path) -> dict[str, dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else {}


def main() -> None:
    args = parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="vime-bench-async-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = bench_model(work / "model", args.size, gpu=args.engine == "vllm")
    console.print(f"model {args.size} built in {time.monotonic() - t0:.0f}s")
    kept = args.results or work / "results.json"
    results = {m: r | {"from": "an earlier call"} for m, r in _read(kept).items() if m not in args.modes}
    for mode in args.modes:  # back to back
        results[mode] = run_mode(work, args, model, mode)
        kept.write_text(json.dumps(_read(kept) | {mode: results[mode]}))
    emit(
        "async",
        engine=args.engine,
        size=args.size,
        samples=args.prompts * args.n,
        response_len=args.response_len,
        **report(results),
    )


if __name__ == "__main__":
    main()
