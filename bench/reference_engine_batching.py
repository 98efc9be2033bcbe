"""Reference engine throughput: concurrent (batched) generation against one-at-a-time, in the same run.

Starts the CPU reference engine as a real process with a tiny kit model, then measures decode
throughput (generated tokens per second of wall time, over HTTP) twice: requests sent one after
another (the baseline: one sequence per forward pass), and ``--concurrency`` requests in flight at
once (continuous batching: many sequences per pass). Prints both and their ratio, plus how many
sequences the engine decoded per forward pass (from its ``/debug/state``).

    python bench/reference_engine_batching.py [--size micro] [--concurrency 256] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from vime import procs
from vime.clients.engine import EngineClient
from vime.models.tiny import ensure_tiny_qwen3

console = Console()


def _prompt(i: int) -> list[int]:
    return [5 + i % 60, 7 + i % 13, 9 + i % 5, 11, 13 + i % 7, 17]


async def _state(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as c:
        return dict((await c.get(url + "/debug/state")).json())


async def _run(client: EngineClient, url: str, n: int, concurrent: bool, max_tokens: int) -> dict[str, float]:
    sp = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "logprobs": 1}
    before = await _state(url)
    start = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        bar = progress.add_task("concurrent" if concurrent else "one at a time", total=n)

        async def one(i: int) -> int:
            result = await client.generate(_prompt(i), {**sp, "seed": i})
            progress.advance(bar)
            return len(result.token_ids)

        if concurrent:
            tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
        else:
            tokens = sum([await one(i) for i in range(n)])
    wall = time.perf_counter() - start
    after = await _state(url)
    steps = after["steps"] - before["steps"]
    return {
        "requests": n,
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "seq_per_pass": tokens / steps,
    }


async def bench(url: str, args: argparse.Namespace) -> None:
    async with EngineClient(url, timeout=1800) as client:
        await client.generate(_prompt(0), {"max_tokens": 4})  # warm-up
        seq = await _run(client, url, args.sequential, False, args.max_tokens)
        batched = await _run(client, url, args.concurrency, True, args.max_tokens)
    table = Table(title=f"reference engine, tiny-qwen3-{args.size}, {args.max_tokens} tokens per request")
    for col in ("mode", "requests", "tokens", "wall s", "tokens/s", "sequences per pass"):
        table.add_column(col)
    for name, r in (("one at a time", seq), (f"{args.concurrency} concurrent", batched)):
        table.add_row(
            name,
            str(r["requests"]),
            str(r["tokens"]),
            f"{r['wall_s']:.2f}",
            f"{r['tok_s']:.0f}",
            f"{r['seq_per_pass']:.1f}",
        )
    console.print(table)
    console.print(f"batched / one-at-a-time throughput: [bold]{batched['tok_s'] / seq['tok_s']:.1f}x[/bold]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="micro", choices=["nano", "micro", "small"])
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--sequential", type=int, default=8, help="requests in the one-at-a-time baseline")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--cache", type=Path, default=None, help="where kit models are built (default: a temp dir)"
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_tiny_qwen3(args.cache or Path(tmp), args.size)
        port = procs.free_port()
        argv = procs.python_module(
            "vime_rollout.reference_engine",
            "--model",
            str(model),
            "--port",
            str(port),
            "--max-batch",
            str(args.concurrency),
        )
        child = procs.start("reference-engine", argv, log_path=Path(tmp) / "engine.log")
        url = f"http://127.0.0.1:{port}"
        try:
            procs.wait_healthy(url, child, timeout_s=180)
            asyncio.run(bench(url, args))
        finally:
            child.stop()


if __name__ == "__main__":
    main()
