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
rollout loop's own wall time) and end to end (the whole POST), and their medians. Goal ≥ 0.97.

    python bench/rollout_overhead.py [--engine fake|reference] [--engines 2] [--prompts 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from vime import procs
from vime.clients.rollout import RolloutClient
from vime.clients.router import RouterDataClient
from vime.config import load_config
from vime.models.tiny import ensure_tiny_qwen3
from vime.types import Sample
from vime.wire.vllm import GENERATE_PATH

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


async def direct_round(
    urls: list[str], payloads: list[dict[str, Any]], concurrency: int
) -> tuple[int, float]:
    """All payloads straight to the engines, round-robin, at most ``concurrency`` in flight, with the
    same HTTP client the manager uses towards the router."""
    sem = asyncio.Semaphore(concurrency)
    clients = [RouterDataClient(u, timeout_s=600) for u in urls]
    targets = itertools.cycle(clients)

    async def one(payload: dict[str, Any], client: RouterDataClient) -> int:
        async with sem:
            out = await client.post(GENERATE_PATH, payload)
            return len(out["choices"][0]["token_ids"])

    try:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p, next(targets)) for p in payloads))
        return sum(tokens), time.perf_counter() - start
    finally:
        for c in clients:
            await c.aclose()


def direct_payloads(cfg_path: Path, model_path: Path, prompts: int, n: int) -> list[dict[str, Any]]:
    """The manager's own requests for the first ``prompts`` prompts of its data source."""
    from vime_rollout.data import DataSource
    from vime_rollout.factory import build_datasets
    from vime_rollout.model import load_tokenizer, served_model_name
    from vime_rollout.rollout.generate import request_payload
    from vime_rollout.rollout.state import GenerateState, SamplingSettings

    cfg = load_config(cfg_path)
    tok = load_tokenizer(model_path)
    train, _ = build_datasets(cfg, tok)
    groups = DataSource(train, n, shuffle=False).get_samples(prompts)

    class _Nothing:
        async def score(self, samples: list[Sample]) -> list[tuple[float, None]]:
            return []

        async def generate(self, payload: dict[str, Any], *, session_id: str | None = None) -> dict[str, Any]:
            return {}

    state = GenerateState(
        cfg=cfg,
        tokenizer=tok,
        generator=_Nothing(),
        scorer=_Nothing(),
        model_name=served_model_name(cfg, model_path),
        sampling=SamplingSettings.for_training(cfg),
        concurrency=1,
        weight_version=lambda: 0,
    )
    return [request_payload(state, s, cfg.rollout_max_response_len, None) for g in groups for s in g]


async def measure(
    args: argparse.Namespace, cfg_path: Path, cfg: dict[str, Any], model_path: Path
) -> list[dict[str, float]]:
    url = f"http://127.0.0.1:{cfg['services']['rollout_port']}"
    rows = []
    async with RolloutClient(url, token=TOKEN) as client:
        engines = [e.url for e in (await client.engines()).engines]
        payloads = direct_payloads(cfg_path, model_path, args.prompts, args.n)
        concurrency = args.concurrency * len(engines)
        await direct_round(engines, payloads[: len(engines) * 4], concurrency)  # warm-up
        await client.rollout(10_000)
        router = f"http://127.0.0.1:{cfg['services']['router_port']}"
        for r in range(args.rounds):
            d_tokens, d_wall = await direct_round(engines, payloads, concurrency)
            r_tokens, r_wall = await direct_round([router], payloads, concurrency)
            start = time.perf_counter()
            job = await client.rollout(r)
            e2e = time.perf_counter() - start
            m = job.metrics
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


def start_fake_engines(work: Path, args: argparse.Namespace) -> tuple[list[procs.Child], list[str]]:
    """Fake engines: a fixed delay and a fixed number of tokens per request, no CPU."""
    script = Path(__file__).resolve().parents[1] / "tests" / "support" / "fake_engine.py"
    children, urls = [], []
    for k in range(args.engines):
        port = procs.free_port()
        argv = [sys.executable, str(script), "--port", str(port), "--engine-id", f"e{k}"]
        argv += ["--delay-s", str(args.delay_s), "--max-tokens-cap", str(args.response_len)]
        children.append(procs.start(f"fake{k}", argv, log_path=work / "logs" / f"fake{k}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    for child, url in zip(children, urls, strict=True):
        procs.wait_healthy(url, child, timeout_s=60)
    return children, urls


def start_stack(work: Path, cfg_path: Path, cfg: dict[str, Any]) -> list[procs.Child]:
    s = cfg["services"]
    logs = work / "logs"
    children = []
    reward = procs.start(
        "reward", procs.python_module("vime_reward", "--config", str(cfg_path)), log_path=logs / "reward.log"
    )
    children.append(reward)
    router = procs.start(
        "router",
        procs.python_module("vime_router", "--config", str(cfg_path), "--log-dir", str(logs)),
        log_path=logs / "router.log",
    )
    children.append(router)
    procs.wait_healthy(f"http://127.0.0.1:{s['reward_port']}", reward, timeout_s=120)
    procs.wait_healthy(f"http://127.0.0.1:{s['router_control_port']}", router, timeout_s=120)
    manager = procs.start(
        "rollout",
        procs.python_module("vime_rollout", "--config", str(cfg_path), "--log-dir", str(logs)),
        log_path=logs / "rollout.log",
        env={"VIME_MODEL_CACHE": str(work / "models")},
    )
    children.append(manager)
    procs.wait_healthy(f"http://127.0.0.1:{s['rollout_port']}", manager, timeout_s=900)
    return children


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
            children, urls = start_fake_engines(work, args)
        cfg_path, cfg = write_config(work, args, redis_port, urls)
        with console.status("starting reward, router, rollout manager and engines"):
            children += start_stack(work, cfg_path, cfg)
        rows = asyncio.run(measure(args, cfg_path, cfg, model_path))
    finally:
        for child in reversed(children):
            child.stop()
        redis.stop()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
