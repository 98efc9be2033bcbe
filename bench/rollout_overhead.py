"""Generation through the rollout manager + router vs. driving the engines directly.

Both sides send the same prompts with the same sampling parameters (the manager's own request
builder, seed step 19) at the same concurrency (``vllm_server_concurrency × engines``) to the
same engines, alternately, several rounds. The direct side round-robins over the engine URLs with
the same HTTP client the manager uses and does nothing else; the manager side is a real
``POST /v1/rollouts`` (data source, router service + vllm-router, reward service, batch
building, Redis publish). Throughput is compared in generated tokens per second.

Engines (``--engine``):
- ``fake`` (default): `tests/support/fake_engine.py` processes that answer after a fixed delay
  with a fixed number of tokens and use no CPU, like GPU engines seen from the host. What is
  left is the manager's and router's own cost, measured without noise from CPU-bound engines.
- ``reference``: the CPU reference engines started by the manager. On a small shared machine the
  engines, reward service, router and manager compete for the same cores, so the figures swing.

Printed: tokens/s of both per round, the ratio manager / direct of the generation phase (the
rollout loop's own wall time) and end to end (the whole POST), and their medians (goal ≥ 0.98);
per round, the manager's extra time over the direct round by part (`gpu_common.gap_parts`).

    python bench/rollout_overhead.py [--engine fake|reference] [--engines 2] [--prompts 32] [--rounds 5]
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
from gpu_common import direct_round, gap_parts, manager_payloads
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

from tests.support.rollout_stack import start_rollout_services
from tests.support.router_harness import start_fake_engines
from vime import procs
from vime.clients.rollout import RolloutClient
from vime.config import load_config
from vime.models.tiny import ensure_tiny_qwen3

console = Console()
TOKEN = "bench-token"


def write_config(
    work: Path, args: argparse.Namespace, redis_port: int, engine_urls: list[str]
) -> tuple[Path, dict[str, Any]]:
    base = procs.free_port()
    ports = {name: procs.free_port() for name in ("router", "router_control", "reward", "rollout")}
    cfg: dict[str, Any] = {
        "run_id": f"bench-{int(time.time())}",
        "output_dir": str(work / "runs"),
        "colocate": False,
        "rollout_batch_size": args.prompts,
        "n_samples_per_prompt": args.n,
        "rollout_max_prompt_len": 32,
        "rollout_max_response_len": args.response_len,
        "rollout_max_context_len": 32 + args.response_len,
        "rollout_num_gpus": 0,
        "rollout_num_engines_cpu": args.engines,
        "vllm_server_concurrency": args.concurrency,
        "actor_num_gpus_per_node": 0,
        "actor_num_cpu_ranks": 1,
        "tensor_model_parallel_size": 1,
        "micro_batch_size": args.n,
        "model": {"tiny_model_size": args.size},
        "data": {"rollout_shuffle": False},
        "reward": {"num_workers": 1},
        "engine": (
            {"launcher": "external", "urls": engine_urls}
            if engine_urls
            else {"backend": "reference", "base_port": base, "startup_timeout_s": 600}
        ),
        "router": {"policy": "round_robin"},
        "services": {
            "host": "127.0.0.1",
            **{f"{k}_port": v for k, v in ports.items()},
            "redis_url": f"redis://127.0.0.1:{redis_port}/0",
            "api_token": TOKEN,
        },
    }
    path = work / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


async def measure(
    args: argparse.Namespace, cfg_path: Path, cfg: dict[str, Any], model_path: Path
) -> list[dict[str, float]]:
    url = f"http://127.0.0.1:{cfg['services']['rollout_port']}"
    rows = []
    async with RolloutClient(url, token=TOKEN) as client:
        engines = [e.url for e in (await client.engines()).engines]
        payloads = manager_payloads(load_config(cfg_path), model_path, logprobs=None)
        concurrency = args.concurrency * len(engines)
        await direct_round(engines, payloads[: len(engines) * 4], concurrency)  # warm-up
        await client.rollout(10_000)
        router = f"http://127.0.0.1:{cfg['services']['router_port']}"
        for r in range(args.rounds):
            replies: list[float] = []
            d_tokens, d_wall = await direct_round(engines, payloads, concurrency, replies)
            r_tokens, r_wall = await direct_round([router], payloads, concurrency)
            start = time.perf_counter()
            job = await client.rollout(r)
            e2e = time.perf_counter() - start
            m = job.metrics
            console.print(f"  gap to direct, by part (s): {gap_parts(m, e2e, d_wall, replies)}")
            rows.append(
                {
                    "direct_tps": d_tokens / d_wall,
                    "router_tps": r_tokens / r_wall,
                    "manager_tps": m["rollout/generated_tokens"] / m["rollout/wall_s"],
                    "manager_e2e_tps": m["rollout/generated_tokens"] / e2e,
                    "direct_tokens": float(d_tokens),
                    "manager_tokens": m["rollout/generated_tokens"],
                }
            )
            console.print(
                f"round {r}: direct {rows[-1]['direct_tps']:.0f} tok/s, router only "
                f"{rows[-1]['router_tps']:.0f} tok/s, manager {rows[-1]['manager_tps']:.0f} tok/s"
            )
    return rows


def report(args: argparse.Namespace, rows: list[dict[str, float]]) -> None:
    """Each round's throughputs and ratios, then the median ratios against the goal."""
    what = (
        f"fake engines ({args.delay_s} s/request)"
        if args.engine == "fake"
        else f"reference engines ({args.size})"
    )
    table = Table(title=f"rollout overhead: {args.engines} {what}, {args.prompts}×{args.n} samples")
    cols = (
        "round",
        "direct tok/s",
        "router only tok/s",
        "manager tok/s",
        "ratio (generation)",
        "ratio (end to end)",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for i, r in enumerate(rows):
        table.add_row(
            str(i),
            f"{r['direct_tps']:.0f}",
            f"{r['router_tps']:.0f}",
            f"{r['manager_tps']:.0f}",
            f"{r['manager_tps'] / r['direct_tps']:.3f}",
            f"{r['manager_e2e_tps'] / r['direct_tps']:.3f}",
        )
    console.print(table)
    gen = statistics.median(r["manager_tps"] / r["direct_tps"] for r in rows)
    e2e = statistics.median(r["manager_e2e_tps"] / r["direct_tps"] for r in rows)
    console.print(f"median ratio manager/direct: generation {gen:.3f}, end to end {e2e:.3f} (goal >= 0.97)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["fake", "reference"], default="fake")
    p.add_argument("--delay-s", type=float, default=2.0, help="fake engines: seconds per request")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32, help="vllm_server_concurrency (per engine)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", default="micro", choices=["nano", "micro", "small"])
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vime-bench-rollout-"))
    model_path = ensure_tiny_qwen3(work / "models", args.size).resolve()
    redis_port = procs.free_port()
    redis = procs.start_redis(redis_port, work / "redis", appendonly=False)
    children: list[procs.Child] = []
    try:
        urls: list[str] = []
        if args.engine == "fake":
            fakes = start_fake_engines(
                args.engines, work / "logs", delay_s=args.delay_s, max_tokens_cap=args.response_len
            )
            children, urls = [e.child for e in fakes], [e.url for e in fakes]
        cfg_path, cfg = write_config(work, args, redis_port, urls)
        with console.status("starting reward, router, rollout manager and engines"):
            start_rollout_services(
                cfg_path,
                cfg["services"],
                work / "logs",
                children,
                manager_env={"VIME_MODEL_CACHE": str(work / "models")},
                manager_timeout_s=900,
            )
        rows = asyncio.run(measure(args, cfg_path, cfg, model_path))
    finally:
        for child in reversed(children):
            child.stop()
        redis.stop()
    report(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
