"""What the router costs on the generate path: throughput and latency through it vs. straight to the engines.

    python bench/router_overhead.py [--engines 4] [--concurrency 256 2048] [--delay-s 1.0 2.0] [--duration-s 20]

Starts ``--engines`` fake engines (tests/support/fake_engine.py) that answer every generate after a
fixed delay, and the router service (``python -m vime_router``: route filter → vllm-router) in
front of them. For each concurrency (with its delay: one ``--delay-s`` per concurrency, or one for
all) it runs a closed loop of that many concurrent generate requests (seed step 20's body: 200
prompt tokens, logprobs=1) for ``--duration-s``: straight to the engines (client-side round robin,
the baseline), then through the router, ``--rounds`` times. Worker starts are spread over one
delay so completions arrive steadily, as in a rollout whose responses differ in length.

Reported over the window after ``--warmup-s``: completed requests per second, latency
percentiles, the ratios router / direct throughput (goal ≥ 0.98) and p99 latency overhead (goal
< 5 ms), and the CPU each process spent per request (client, engines, route filter, vllm-router):
the router's cost in CPU-seconds, which is what decides its overhead once the machine is busy.
The same aiohttp client (uvloop) drives both modes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

from tests.support.router_harness import (
    FakeEngineProcess,
    RouterProcess,
    start_fake_engines,
    start_router,
    stop_all,
)
from vime.wire.vllm import GENERATE_PATH

console = Console(width=200)
BODY = json.dumps(
    {
        "model": "fake",
        "token_ids": [151644, 872, 198, *range(1000, 1197)],
        "sampling_params": {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "logprobs": 1, "top_k": -1},
    }
).encode()


@dataclass
class RunResult:
    mode: str
    concurrency: int
    delay_s: float
    throughput: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    errors: int
    cpu_us: dict[str, float] = field(default_factory=dict)
    """CPU microseconds per completed request, by process."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def closed_loop(  # type: ignore[no-untyped-def]
    urls: list[str],
    concurrency: int,
    delay_s: float,
    args: argparse.Namespace,
    mode: str,
    sockets: Sequence[str] = (),
    headers: dict[str, str] | None = None,
):
    """``concurrency`` workers, each sending one request after another until ``duration_s``; worker
    ``i`` to ``urls[i % len(urls)]``, over TCP or, given ``sockets``, over ``sockets[i % len]``."""
    connectors: list[aiohttp.BaseConnector] = [
        aiohttp.UnixConnector(path=s, limit=0, keepalive_timeout=15) for s in sockets
    ] or [aiohttp.TCPConnector(limit=0, keepalive_timeout=15, happy_eyeballs_delay=None)]
    headers = {"content-type": "application/json", **(headers or {})}
    done: list[tuple[float, float]] = []
    errors = 0
    clock = time.perf_counter  # uvloop's loop.time() has millisecond resolution
    async with contextlib.AsyncExitStack() as stack:
        sessions = [
            await stack.enter_async_context(
                aiohttp.ClientSession(connector=c, timeout=aiohttp.ClientTimeout(total=300))
            )
            for c in connectors
        ]
        start = clock()
        stop_at = start + args.duration_s

        async def worker(i: int) -> None:
            nonlocal errors
            url, session = urls[i % len(urls)], sessions[i % len(sessions)]
            await asyncio.sleep(delay_s * i / concurrency)
            while clock() < stop_at:
                t0 = clock()
                try:
                    async with session.post(url, data=BODY, headers=headers) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    done.append((t0 - start, clock() - start))
                else:
                    errors += 1

        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"{mode:>6} c={concurrency}", total=args.duration_s)
            workers = asyncio.gather(*(worker(i) for i in range(concurrency)))
            while not workers.done():
                progress.update(task, completed=min(args.duration_s, clock() - start))
                await asyncio.sleep(0.25)
            await workers
    return done, errors


def run_once(
    mode: str,
    urls: list[str],
    c: int,
    delay_s: float,
    pids: dict[str, int],
    args: argparse.Namespace,
    **transport: Any,
) -> RunResult:
    """One closed loop (``transport``: `closed_loop`'s ``sockets`` and ``headers``), its CPU by process."""
    import uvloop

    before = {k: cpu_seconds(p) for k, p in pids.items()}
    client_before = time.process_time()
    done, errors = uvloop.run(closed_loop(urls, c, delay_s, args, mode, **transport))
    cpu = {k: cpu_seconds(p) - before[k] for k, p in pids.items()}
    cpu["client"] = time.process_time() - client_before
    n = max(1, len(done))
    per_request = {k: v / n * 1e6 for k, v in cpu.items() if not k.startswith("engine ")}
    per_request["engines"] = sum(v for k, v in cpu.items() if k.startswith("engine ")) / n * 1e6
    window = [(s, e) for s, e in done if args.warmup_s <= e <= args.duration_s]
    latencies = sorted((e - s) * 1000 for s, e in window if s >= args.warmup_s)
    return RunResult(
        mode=mode,
        concurrency=c,
        delay_s=delay_s,
        throughput=len(window) / (args.duration_s - args.warmup_s),
        p50_ms=pct(latencies, 0.50),
        p99_ms=pct(latencies, 0.99),
        max_ms=latencies[-1] if latencies else float("nan"),
        errors=errors,
        cpu_us=per_request,
    )


def summarize(results: list[RunResult], c: int) -> dict[str, float]:
    """Ratios over paired rounds (each round runs every mode back to back); medians resist noise."""
    by = {m: [r for r in results if r.mode == m and r.concurrency == c] for m in ("direct", "bare", "router")}

    def paired(mode: str, base: str, key: str, ratio: bool = False) -> float:
        pairs = zip(by[mode], by[base], strict=True)
        if ratio:
            return statistics.median(getattr(a, key) / getattr(b, key) for a, b in pairs)
        return statistics.median(getattr(a, key) - getattr(b, key) for a, b in pairs)

    def cpu(mode: str, key: str) -> float:
        return statistics.median(r.cpu_us.get(key, 0.0) for r in by[mode])

    delay = by["direct"][0].delay_s
    out = {
        "concurrency": c,
        "delay_s": delay,
        "rounds": len(by["direct"]),
        "offered_rps": c / delay,
        "direct_rps": statistics.median(r.throughput for r in by["direct"]),
        "router_rps": statistics.median(r.throughput for r in by["router"]),
        "throughput_ratio": paired("router", "direct", "throughput", ratio=True),
        "p50_overhead_ms": paired("router", "direct", "p50_ms"),
        "p99_overhead_ms": paired("router", "direct", "p99_ms"),
        "filter_cpu_us": cpu("router", "route-filter"),
        "vllm_router_cpu_us": cpu("router", "vllm-router"),
        "engines_extra_cpu_us": cpu("router", "engines") - cpu("direct", "engines"),
    }
    if by["bare"]:  # the route filter alone: router (filter + vllm-router) vs vllm-router
        out["filter_throughput_ratio"] = paired("router", "bare", "throughput", ratio=True)
        out["filter_p50_overhead_ms"] = paired("router", "bare", "p50_ms")
        out["filter_p99_overhead_ms"] = paired("router", "bare", "p99_ms")
    return out


RUN_COLUMNS = ("mode", "conc.", "delay s", "req/s", "p50 ms", "p99 ms", "max ms", "err")
CPU_COLUMNS = ("client", "engines", "route-filter", "vllm-router")
SUMMARY_COLUMNS = ("conc.", "offered req/s", "direct req/s", "router req/s", "ratio", "p50 +ms", "p99 +ms")


def runs_table(results: list[RunResult], cpu_columns: Sequence[str] = CPU_COLUMNS) -> Table:
    table = Table(title="runs (CPU µs per request by process)")
    for col in (*RUN_COLUMNS, *cpu_columns):
        table.add_column(col, justify="right")
    for r in results:
        row = [r.mode, str(r.concurrency), f"{r.delay_s:g}", f"{r.throughput:.1f}"]
        row += [f"{v:.1f}" for v in (r.p50_ms, r.p99_ms, r.max_ms)] + [str(r.errors)]
        table.add_row(*row, *(f"{r.cpu_us.get(k, 0):.0f}" for k in cpu_columns))
    return table


def summary_table(summaries: list[dict[str, float]]) -> Table:
    table = Table(
        title="router vs direct, medians over paired rounds (goal: ratio ≥ 0.98, p99 overhead < 5 ms)"
    )
    for col in (*SUMMARY_COLUMNS, "router CPU µs/req", "goal"):
        table.add_column(col, justify="right")
    for s in summaries:
        met = s["throughput_ratio"] >= 0.98 and s["p99_overhead_ms"] < 5.0
        added = s["filter_cpu_us"] + s["vllm_router_cpu_us"] + s["engines_extra_cpu_us"]
        bound = s["direct_rps"] < 0.95 * s["offered_rps"]
        table.add_row(
            str(int(s["concurrency"])),
            *(f"{s[k]:.1f}" for k in ("offered_rps", "direct_rps", "router_rps")),
            f"{s['throughput_ratio']:.4f}",
            f"{s['p50_overhead_ms']:+.2f}",
            f"{s['p99_overhead_ms']:+.2f}",
            f"{added:.0f} (filter {s['filter_cpu_us']:.0f}, vllm-router {s['vllm_router_cpu_us']:.0f})",
            ("met" if met else "NOT met") + (" (the baseline itself is CPU-bound)" if bound else ""),
        )
    return table


def report(results: list[RunResult], summaries: list[dict[str, float]]) -> None:
    console.print(runs_table(results))
    console.print(summary_table(summaries))
    for s in summaries:
        if "filter_throughput_ratio" in s:
            console.print(
                f"route filter alone at c={int(s['concurrency'])}: throughput x{s['filter_throughput_ratio']:.4f}, "
                f"p50 {s['filter_p50_overhead_ms']:+.2f} ms, p99 {s['filter_p99_overhead_ms']:+.2f} ms, "
                f"{s['filter_cpu_us']:.0f} µs CPU per request"
            )


def loop_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options of the closed loops (engines, concurrencies, delays, durations, rounds, JSON)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=[256, 2048])
    p.add_argument(
        "--delay-s", type=float, nargs="+", default=[1.0, 2.0], help="engine delay, per concurrency"
    )
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3, help="rounds of all modes back to back, per concurrency")
    p.add_argument("--json-out", help="write runs and summaries here")
    return p


def delays(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[float]:
    """One engine delay per concurrency (``--delay-s`` given once or once per ``--concurrency``)."""
    out: list[float] = args.delay_s * len(args.concurrency) if len(args.delay_s) == 1 else args.delay_s
    if len(out) != len(args.concurrency):
        p.error("give one --delay-s or one per --concurrency")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = loop_parser(__doc__)
    p.add_argument(
        "--policy", default="round_robin", choices=["round_robin", "power_of_two", "consistent_hash"]
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=["direct", "router"],
        choices=["direct", "bare", "router"],
        help="bare = vllm-router's private port, without the route filter (isolates the filter's cost)",
    )
    args = p.parse_args(argv)
    args.delays = delays(p, args)
    if "direct" not in args.modes or "router" not in args.modes:
        p.error("keep the direct and router modes")
    return args


def run_all(
    args: argparse.Namespace, engines: list[FakeEngineProcess], router: RouterProcess
) -> list[RunResult]:
    """Every concurrency, ``rounds`` times every mode back to back."""
    for e in engines:
        router.register(e)
    dp = httpx.get(f"{router.control_url}/v1/data-plane", headers=router.headers()).json()
    pids = {"route-filter": dp["filter_pid"], "vllm-router": dp["router_pid"]}
    pids |= {f"engine {e.engine_id}": e.child.pid for e in engines}
    targets = {
        "direct": {"urls": [e.url + GENERATE_PATH for e in engines]},
        "bare": {"urls": [dp["router_url"] + GENERATE_PATH]},  # vllm-router without the filter
        "router": {"urls": [router.data_url + GENERATE_PATH]},
    }
    return run_rounds(args, engines, pids, targets)


def run_rounds(
    args: argparse.Namespace,
    engines: list[FakeEngineProcess],
    pids: dict[str, int],
    targets: dict[str, dict[str, Any]],
) -> list[RunResult]:
    """Every concurrency (the engines' delay set to its own), ``rounds`` times every mode back to
    back; ``targets``: each mode's `run_once` keywords (``urls``, ``sockets``, ``headers``)."""
    results = []
    for c, delay in zip(args.concurrency, args.delays, strict=True):
        for e in engines:
            e.configure(delay_s=delay)
        for _ in range(args.rounds):
            for mode in args.modes:
                r = run_once(mode, c=c, delay_s=delay, pids=pids, args=args, **targets[mode])
                console.print(
                    f"{mode:>6} c={c} delay={delay:g}s: {r.throughput:.1f} req/s, p99 {r.p99_ms:.1f} ms"
                )
                results.append(r)
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="vime-bench-router-"))
    console.print(f"logs in {logs}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    engines = start_fake_engines(args.engines, logs, delay_s=args.delays[0], max_tokens_cap=16)
    router = None
    try:
        router = start_router(logs, overrides=[f"router.policy={args.policy}"])
        results = run_all(args, engines, router)
    finally:
        stop_all([*(e.child for e in engines), *([router.child] if router else [])])
    summaries = [summarize(results, c) for c in args.concurrency]
    report(results, summaries)
    finish(args, results, summaries)


def finish(args: argparse.Namespace, results: list[RunResult], summaries: Any) -> None:
    """The load average after, and with ``--json-out`` the runs and summaries in that file."""
    console.print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.json_out:
        payload = {"args": vars(args), "runs": [asdict(r) for r in results], "summaries": summaries}
        Path(args.json_out).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
