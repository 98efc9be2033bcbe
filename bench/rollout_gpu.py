"""Rollout throughput through the rollout manager + router vs straight to the engine, same run, same engine.

The seed's rollout shape on one GPU: 256 samples (32 prompts × 8) of a 200-token prompt and up to
``--max-tokens`` (1024) output tokens, all in flight at once, temperature 1, against one real
``vllm serve`` started with the rollout manager's own command builder (dummy weights of a Qwen3
shape, CUDA graphs on, sleep mode and the IPC transfer config on, as colocated engines run).
With dummy weights the next-token distribution is near-uniform over 151,936 ids, so EOS almost
never comes and responses run to ``--max-tokens`` on both sides.

Per variant — with per-token log-probs (what rollout-logprob training and the mismatch metrics
need) and without — the same requests (the manager's own request builder, seed step 19) are sent:

- ``direct``: straight to the engine's own ``/inference/v1/generate`` with the manager's HTTP
  client, nothing else; with log-probs also to vime's compact route (``/vime/v1/generate``: the
  same request, the log-probs as one list of floats), which the manager's requests take;
- ``manager``: ``POST /v1/rollouts`` on a rollout manager (engine given as external) → router
  (vllm-router) → engine, rewards, batch building, Redis publish. Its generation-phase
  throughput (``rollout/wall_s``) and end-to-end throughput (the whole POST) are both reported,
  and its extra time over the direct round, part by part (`gpu_common.gap_parts`, from the
  rollout's own ``rollout/t_*`` metrics).

After a warm-up (the whole batch once, 32 tokens each, and one evaluation rollout as wide as the
batch), ``--rounds``
rounds of both (default 2), the order swapped every round (odd rounds: manager first), so that
neither side always runs on the colder engine; the medians are reported (one round on the H100
on 12-06 had the manager 1.24× the direct round with log-probs, which order alone can do).

Printed: output tokens/s of each side and manager / direct (goal ≥ 0.98), the compact route over
vLLM's own (direct, with log-probs), and the manager with log-probs over direct without (goal ≥ 0.8); per
round, the engine's load while each side ran (`engine_load`: peak and mean running requests, when
the peak came, peak waiting). Raw
vLLM 0.26 on one H200 did ~9k tok/s with ``logprobs: 1`` and ~27k without (notes/gpu_baselines.md).

    python bench/rollout_gpu.py --engine vllm --size qwen3-0.6b --samples 256 --max-tokens 1024
    python bench/rollout_gpu.py --engine reference --size micro --samples 16 --max-tokens 16   # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from engine_load import engine_load
from gpu_common import (
    bench_model,
    console,
    direct_round,
    emit,
    gap_parts,
    manager_payloads,
    start_engine,
    wait_engine,
    write_prompts,
)
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

from tests.support.rollout_stack import start_rollout_services
from vime import procs
from vime.clients.rollout import RolloutClient
from vime.config import load_config
from vime.models.tiny import QWEN3_SHAPES, SHAPES
from vime.wire.vllm import COMPACT_GENERATE_PATH, logprobs_to_request

TOKEN = "bench-token"
N = 8
PROMPT_LEN = 200


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["vllm", "reference"], default="vllm")
    p.add_argument("--size", default="qwen3-0.6b", choices=[*SHAPES, *QWEN3_SHAPES])
    p.add_argument("--samples", type=int, default=256, help="a multiple of 8 (prompts × 8)")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="direct + manager rounds per variant (odd rounds: manager first)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--work", type=Path, default=None)
    return p.parse_args()


def engine_config(args: argparse.Namespace, port: int) -> Any:
    gpu = args.engine == "vllm"
    layout = (
        {"rollout_num_gpus": 1, "actor_num_gpus_per_node": 1}
        if gpu
        else {"rollout_num_gpus": 0, "rollout_num_engines_cpu": 1, "actor_num_gpus_per_node": 0}
    )
    extra = ["--load-format", "dummy", "--max-num-seqs", "512"] if gpu else []
    return load_config(
        base={
            **layout,
            "rollout_num_gpus_per_engine": 1,
            "tensor_model_parallel_size": 1,
            "colocate": True,
            "rollout_max_prompt_len": 256,
            "rollout_max_response_len": 4096 - 256,
            "rollout_max_context_len": 4096,
            "engine": {
                "backend": args.engine,
                "base_port": port,
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "extra_args": extra,
                "reference_max_batch": 256,
            },
        },
        environ={},
    )


def manager_config(
    work: Path, args: argparse.Namespace, model: Path, engine_url: str, redis_port: int, logprobs: bool
) -> dict[str, Any]:
    ports = {f"{n}_port": procs.free_port() for n in ("router", "router_control", "reward", "rollout")}
    prompts = args.samples // N
    return {
        "run_id": f"bench-rollout-{'lp' if logprobs else 'nolp'}",
        "output_dir": str(work / "runs"),
        "colocate": False,
        "rollout_batch_size": prompts,
        "n_samples_per_prompt": N,
        "micro_batch_size": N,
        "rollout_max_prompt_len": 256,
        "rollout_max_response_len": args.max_tokens,
        "rollout_max_context_len": 256 + args.max_tokens,
        "rollout_num_gpus": 0,
        "actor_num_gpus_per_node": 0,
        "tensor_model_parallel_size": 1,
        "vllm_server_concurrency": max(512, args.samples),
        "rollout_logprobs_fraction": 1.0 if logprobs else 0.0,
        "model": {"hf_checkpoint": str(model), "served_model_name": "bench"},
        "data": {
            "prompt_data": str(work / "prompts.jsonl"),
            "eval_prompt_data": {"warmup": str(work / "warmup.jsonl")},
            "n_samples_per_eval_prompt": N,
            "eval_temperature": 1.0,
            "rollout_shuffle": False,
        },
        "reward": {"rm_type": "exact_match", "num_workers": 2},
        "engine": {"launcher": "external", "urls": [engine_url]},
        "services": {
            "host": "127.0.0.1",
            **ports,
            "redis_url": f"redis://127.0.0.1:{redis_port}/0",
            "api_token": TOKEN,
        },
    }


def warm_up_form(payloads: list[dict[str, Any]], max_tokens: int = 32) -> list[dict[str, Any]]:
    """The same requests, shorter: the engine sees the full batch (and its log-prob path) once
    before anything is timed."""
    return [p | {"sampling_params": p["sampling_params"] | {"max_tokens": max_tokens}} for p in payloads]


async def _direct_rounds(
    engine_url: str, payloads: list[dict[str, Any]], concurrency: int, logprobs: bool, replies: list[float]
) -> dict[str, float]:
    """The requests straight to the engine's own generate route (with log-probs: then to vime's
    compact route, the one the manager's requests take)."""
    async with engine_load(engine_url) as load:
        tokens, wall = await direct_round([engine_url], payloads, concurrency, replies)
    row = {"direct_tps": tokens / wall, "direct_tokens": float(tokens), "direct_s": wall}
    row |= {f"direct_{k}": v for k, v in load.summary().items()}
    if logprobs:
        c_tokens, c_wall = await direct_round([engine_url], payloads, concurrency, path=COMPACT_GENERATE_PATH)
        row |= {"direct_compact_tps": c_tokens / c_wall, "direct_compact_s": c_wall}
    return row


async def _manager_round(
    client: RolloutClient, rollout_id: int, engine_url: str
) -> tuple[dict[str, float], float, dict[str, float]]:
    """One rollout through the manager: its metrics, the whole POST's seconds, the engine's load."""
    async with engine_load(engine_url) as load:
        t0 = time.perf_counter()
        job = await client.rollout(rollout_id)
        e2e = time.perf_counter() - t0
    return job.metrics, e2e, load.summary()


async def measure(
    url: str, cfg: Any, model: Path, engine_url: str, args: argparse.Namespace, logprobs: bool
) -> list[dict[str, Any]]:
    payloads = manager_payloads(cfg, model, logprobs=logprobs_to_request(None) if logprobs else None)
    concurrency = cfg.rollout_concurrency
    rows = []
    async with RolloutClient(url, token=TOKEN, timeout=1800) as client:
        await direct_round([engine_url], warm_up_form(payloads), concurrency)  # warm-up: engine, full batch
        await client.rollout(10_000, evaluation=True)  # warm-up: router, reward pool, tokenizer
        for r in range(args.rounds):
            replies: list[float] = []
            row: dict[str, Any] = {"manager_first": r % 2 == 1}
            if row["manager_first"]:  # odd rounds swap the order: neither side always runs first
                m, e2e, load = await _manager_round(client, r, engine_url)
                row |= await _direct_rounds(engine_url, payloads, concurrency, logprobs, replies)
            else:
                row |= await _direct_rounds(engine_url, payloads, concurrency, logprobs, replies)
                m, e2e, load = await _manager_round(client, r, engine_url)
            d_wall = row["direct_s"]
            row |= {
                "manager_tps": m["rollout/generated_tokens"] / m["rollout/wall_s"],
                "manager_e2e_tps": m["rollout/generated_tokens"] / e2e,
                "manager_tokens": m["rollout/generated_tokens"],
                "manager_s": m["rollout/wall_s"],
                "manager_e2e_s": e2e,
                "gap_s": gap_parts(m, e2e, d_wall, replies),
            } | {f"manager_{k}": v for k, v in load.items()}
            console.print(
                f"{'with' if logprobs else 'without'} log-probs, round {r}: "
                + ", ".join(f"{k} {v:,.2f}" for k, v in row.items() if isinstance(v, float))
            )
            console.print(f"  gap to direct, by part (s): {row['gap_s']}")
            rows.append(row)
    return rows


def variant(
    work: Path, args: argparse.Namespace, engine_url: str, model: Path, redis_port: int, logprobs: bool
) -> list[dict[str, Any]]:
    """Start a rollout manager for this variant (the engine stays up), measure, stop it."""
    raw = manager_config(work, args, model, engine_url, redis_port, logprobs)
    path = work / f"manager-{'lp' if logprobs else 'nolp'}.yaml"
    path.write_text(yaml.safe_dump(raw))
    logs = work / "logs" / path.stem
    children: list[procs.Child] = []
    try:
        url = start_rollout_services(path, raw["services"], logs, children)
        return asyncio.run(measure(url, load_config(path), model, engine_url, args, logprobs))
    finally:
        for child in reversed(children):
            child.stop()


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, engine_start_s: float) -> None:
    table = Table(
        title=f"rollout: {args.samples} samples × ≤{args.max_tokens} tokens, {args.engine} {args.size}"
    )
    for col in (
        "variant",
        "direct tok/s",
        "direct, compact route",
        "manager tok/s",
        "manager / direct",
        "manager e2e tok/s",
        "e2e / direct",
    ):
        table.add_column(col, justify="right")
    summary: dict[str, Any] = {}
    for name, rows in results.items():
        d = statistics.median(r["direct_tps"] for r in rows)
        m = statistics.median(r["manager_tps"] for r in rows)
        e = statistics.median(r["manager_e2e_tps"] for r in rows)
        compacts = [r["direct_compact_tps"] for r in rows if "direct_compact_tps" in r]
        compact = statistics.median(compacts) if compacts else None
        gaps = {k: round(statistics.median(r["gap_s"][k] for r in rows), 4) for k in rows[0]["gap_s"]}
        table.add_row(
            name,
            f"{d:,.0f}",
            "-" if compact is None else f"{compact:,.0f}",
            f"{m:,.0f}",
            f"{m / d:.3f}",
            f"{e:,.0f}",
            f"{e / d:.3f}",
        )
        summary[name] = {
            "direct_tps": round(d),
            "manager_tps": round(m),
            "ratio": round(m / d, 4),
            "manager_e2e_tps": round(e),
            "ratio_e2e": round(e / d, 4),
            "median_gap_s": gaps,
            "rounds": rows,
        }
        if compact is not None:
            summary[name] |= {
                "direct_compact_tps": round(compact),
                "compact_over_vllm_route": round(compact / d, 4),
            }
        console.print(f"{name}: median gap to direct by part (s): {gaps}")
    console.print(table)
    if {"logprobs", "no_logprobs"} <= set(summary):
        cross = summary["logprobs"]["manager_e2e_tps"] / summary["no_logprobs"]["direct_tps"]
        summary["manager_logprobs_over_direct_no_logprobs"] = round(cross, 4)
        console.print(f"manager with log-probs / direct without: {cross:.3f} (goal ≥ 0.8)")
    emit(
        "rollout",
        engine=args.engine,
        size=args.size,
        samples=args.samples,
        max_tokens=args.max_tokens,
        engine_start_s=round(engine_start_s, 1),
        goal_ratio=0.98,
        goal_logprobs_over_no_logprobs=0.8,
        **summary,
    )


def main() -> None:
    args = parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="vime-bench-rollout-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    gpu = args.engine == "vllm"
    model = bench_model(work / "model", args.size, gpu=gpu, weights=not gpu)
    write_prompts(work / "prompts.jsonl", args.samples // N, PROMPT_LEN)
    # the manager's warm-up as wide as a timed round: on 12-06 its first timed rollout after a
    # 32-request warm-up spread its sends over 0.31 s (0.05 s in later rounds) and lost ~1 s
    write_prompts(work / "warmup.jsonl", args.samples // N, PROMPT_LEN, seed=1)
    cfg = engine_config(args, procs.free_port())
    t0 = time.monotonic()
    child, url = start_engine(cfg, model, "bench", work / "logs")
    redis_port = procs.free_port()
    redis = procs.start_redis(redis_port, work / "redis", appendonly=False)
    try:
        wait_engine(child, url)
        engine_start_s = time.monotonic() - t0
        console.print(f"engine up in {engine_start_s:.0f}s")
        variants = (("logprobs", True), ("no_logprobs", False))
        results = {name: variant(work, args, url, model, redis_port, lp) for name, lp in variants}
    finally:
        child.stop(grace_s=30)
        redis.stop()
    report(results, args, engine_start_s)


if __name__ == "__main__":
    main()
