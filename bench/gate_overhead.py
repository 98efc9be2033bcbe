"""What the engine gate costs on the generate path: throughput and latency through it vs. straight
to the engine's Unix socket (issue 17).

    python bench/gate_overhead.py [--engines 4] [--concurrency 256 2048] [--delay-s 1.0 2.0] [--duration-s 20]

Starts ``--engines`` fake engines (tests/support/fake_engine.py, a fixed delay per generate), each
behind its gate as the rollout manager starts an engine (`vime_rollout.engines.gate`): the engine
on a Unix socket in a private directory, Caddy on a TCP port with the stack's token configured.
The same closed loop as bench/router_overhead.py (its client, body and options) runs, for each
concurrency, ``--rounds`` times in turn: ``direct`` to the engines' sockets (the baseline),
``gate`` through the gates without the token (how vllm-router forwards the data plane's
generate: the route open to all), ``token`` through the gates with ``Authorization: Bearer``
(the first route Caddy matches).

Reported over the window after ``--warmup-s``: completed requests per second, the ratio gated /
direct (goal ≥ 0.98), the added p50 and p99 latency, and the CPU-seconds per request of the Caddy
processes (and what the engines spend beyond the baseline).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.table import Table
from router_overhead import RunResult, console, delays, finish, loop_parser, run_rounds, runs_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

from vime_rollout.engines.gate import private_dir

from tests.support.router_harness import FakeEngineProcess, start_fake_engines, stop_all
from vime.wire.vllm import GENERATE_PATH

TOKEN = "bench-gate-t0ken"
GATED = ("gate", "token")


def run_all(args: argparse.Namespace, engines: list[FakeEngineProcess]) -> list[RunResult]:
    """Every concurrency, ``rounds`` times every mode back to back; Caddy's CPU summed over the gates."""
    pids = {f"engine {e.engine_id}": e.child.pid for e in engines}
    pids |= {f"caddy {e.engine_id}": e.gate.pid for e in engines if e.gate}
    gates = [e.url + GENERATE_PATH for e in engines]
    targets: dict[str, dict[str, Any]] = {
        "direct": {"urls": ["http://engine" + GENERATE_PATH], "sockets": [e.socket for e in engines]},
        "gate": {"urls": gates},
        "token": {"urls": gates, "headers": engines[0].headers()},
    }
    results = run_rounds(args, engines, pids, targets)
    for r in results:
        r.cpu_us["caddy"] = sum(v for k, v in r.cpu_us.items() if k.startswith("caddy "))
    return results


def summarize(results: list[RunResult], c: int, mode: str) -> dict[str, float]:
    """``mode`` against ``direct`` over paired rounds (medians resist noise)."""
    runs = [r for r in results if r.concurrency == c and r.mode == mode]
    base = [r for r in results if r.concurrency == c and r.mode == "direct"]
    pairs = list(zip(runs, base, strict=True))
    return {
        "concurrency": c,
        "offered_rps": c / base[0].delay_s,
        "direct_rps": statistics.median(b.throughput for b in base),
        "gated_rps": statistics.median(r.throughput for r in runs),
        "ratio": statistics.median(r.throughput / b.throughput for r, b in pairs),
        "p50_ms": statistics.median(r.p50_ms - b.p50_ms for r, b in pairs),
        "p99_ms": statistics.median(r.p99_ms - b.p99_ms for r, b in pairs),
        "caddy_cpu_us": statistics.median(r.cpu_us["caddy"] for r in runs),
        "engines_extra_cpu_us": statistics.median(
            r.cpu_us["engines"] - b.cpu_us["engines"] for r, b in pairs
        ),
    }


def summary_table(summaries: dict[str, list[dict[str, float]]]) -> Table:
    table = Table(title="gated vs direct to the socket, medians over paired rounds (goal: ratio ≥ 0.98)")
    columns = ("mode", "conc.", "offered req/s", "direct req/s", "gated req/s", "ratio", "p50 +ms", "p99 +ms")
    for col in (*columns, "Caddy CPU µs/req", "engines +µs/req", "goal"):
        table.add_column(col, justify="right")
    for mode, rows in summaries.items():
        for s in rows:
            bound = s["direct_rps"] < 0.95 * s["offered_rps"]
            table.add_row(
                mode,
                str(int(s["concurrency"])),
                *(f"{s[k]:.1f}" for k in ("offered_rps", "direct_rps", "gated_rps")),
                f"{s['ratio']:.4f}",
                *(f"{s[k]:+.2f}" for k in ("p50_ms", "p99_ms")),
                *(f"{s[k]:.0f}" for k in ("caddy_cpu_us", "engines_extra_cpu_us")),
                ("met" if s["ratio"] >= 0.98 else "NOT met")
                + (" (the baseline is CPU-bound)" if bound else ""),
            )
    return table


def main(argv: list[str] | None = None) -> None:
    p = loop_parser(__doc__)
    p.add_argument("--modes", nargs="+", default=["direct", *GATED], choices=["direct", *GATED])
    args = p.parse_args(argv)
    args.delays = delays(p, args)
    if "direct" not in args.modes:
        p.error("keep the direct mode: it is the baseline")
    logs = Path(tempfile.mkdtemp(prefix="vime-bench-gate-"))
    private = private_dir()
    console.print(f"logs in {logs}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    engines = start_fake_engines(
        args.engines, logs, delay_s=args.delays[0], max_tokens_cap=16, gate_dir=private, token=TOKEN
    )
    try:
        results = run_all(args, engines)
    finally:
        stop_all(c for e in engines for c in e.children())
        shutil.rmtree(private, ignore_errors=True)
    summaries = {m: [summarize(results, c, m) for c in args.concurrency] for m in args.modes if m in GATED}
    console.print(runs_table(results, ("client", "engines", "caddy")))
    console.print(summary_table(summaries))
    finish(args, results, summaries)


if __name__ == "__main__":
    main()
