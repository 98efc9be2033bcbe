"""Reward service throughput for ``math`` on 256 typical answers, against math-verify in one process.

Baselines, measured in the same run on the same answers:
  * ``math-verify direct``: ``verify(parse(label), parse(response))`` in this process, one by one;
  * ``score_math in-process``: the service's own math function (boxed extraction + math-verify),
    called in this process: the work one worker does, without pool or HTTP.
Through the service (a real ``python -m vime_reward`` process on a free port):
  * ``POST /v1/rewards``: the 256 answers as one batch;
  * ``POST /v1/reward`` ×256: one call per sample, all in flight together (what the rollout does).
Each round uses fresh answers (math-verify caches parsed LaTeX), after a warm-up round.
The ratio column is samples/s divided by the direct math-verify baseline's.

    python bench/reward_throughput.py [--workers 2] [--rounds 3] [--samples 256]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

from vime import procs
from vime.clients.reward import RewardClient

Answer = tuple[str, str]  # (response, label)


def typical_answers(n: int, seed: int) -> list[Answer]:
    """MATH-style solutions ending in a boxed answer: integers, fractions, roots, expressions; ~30% wrong."""
    rng = random.Random(seed)
    out: list[Answer] = []
    for _ in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        kind = rng.randrange(5)
        if kind == 0:
            label, right, wrong = str(a * b), f"{a * b}", f"{a * b + 1}"
        elif kind == 1:
            label, right, wrong = (
                f"\\frac{{{a}}}{{{b}}}",
                f"\\dfrac{{{2 * a}}}{{{2 * b}}}",
                f"\\frac{{{b}}}{{{a}}}",
            )
        elif kind == 2:
            label, right, wrong = f"{c}\\sqrt{{{a}}}", f"\\sqrt{{{c * c * a}}}", f"{c + 1}\\sqrt{{{a}}}"
        elif kind == 3:
            label, right, wrong = f"x^2+{2 * a}x+{a * a}", f"(x+{a})^2", f"(x+{a + 1})^2"
        else:
            label, right, wrong = f"{a}.{b:02d}", f"{a}.{b:02d}0", f"{a}.{b + 1:02d}"
        answer = right if rng.random() < 0.7 else wrong
        steps = " ".join(f"Step {k}: we combine {a} and {b} to get an intermediate value." for k in range(4))
        out.append((f"{steps}\nTherefore, the final answer is $\\boxed{{{answer}}}$.", label))
    return out


def direct_math_verify(answers: list[Answer]) -> list[float]:
    from math_verify import parse, verify

    return [1.0 if verify(parse(f"${label}$"), parse(resp)) else 0.0 for resp, label in answers]


def score_math_in_process(answers: list[Answer]) -> list[float]:
    from vime_reward.functions.math_answers import MathOptions, score_math

    opts = MathOptions()
    return [score_math(resp, label, opts).reward for resp, label in answers]


async def via_batch(url: str, answers: list[Answer]) -> list[float]:
    async with RewardClient(url) as client:
        items = [{"response": r, "label": lab} for r, lab in answers]
        return [r.reward for r in await client.score_batch(items, fn="math")]


async def via_singles(url: str, answers: list[Answer]) -> list[float]:
    async with RewardClient(url) as client:
        results = await asyncio.gather(
            *(client.score({"response": r, "label": lab}, fn="math") for r, lab in answers)
        )
        return [r.reward for r in results]


def timed(fn: Callable[[list[Answer]], list[float]], rounds: list[list[Answer]]) -> tuple[float, list[float]]:
    """(samples per second over all rounds, the rewards of the last round)."""
    start = time.perf_counter()
    rewards: list[float] = []
    for answers in rounds:
        rewards = fn(answers)
    return sum(len(r) for r in rounds) / (time.perf_counter() - start), rewards


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2, help="reward service pool size")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (fresh answers each)")
    parser.add_argument("--samples", type=int, default=256, help="answers per round")
    args = parser.parse_args()
    console = Console()
    warm = typical_answers(args.samples, seed=0)
    rounds = [typical_answers(args.samples, seed=1 + r) for r in range(args.rounds)]

    with tempfile.TemporaryDirectory() as tmp:
        port = procs.free_port()
        argv = procs.python_module(
            "vime_reward", "--port", str(port), "--set", f"reward.num_workers={args.workers}", "--insecure"
        )  # built-in functions only: no route it calls needs a token
        child = procs.start("reward", argv, log_path=Path(tmp) / "reward.log")
        url = f"http://127.0.0.1:{port}"
        try:
            procs.wait_healthy(url, child, timeout_s=120)
            contenders: dict[str, Callable[[list[Answer]], list[float]]] = {
                "math-verify direct (1 process)": direct_math_verify,
                "score_math in-process": score_math_in_process,
                f"service POST /v1/rewards ({args.workers} workers)": lambda a: asyncio.run(
                    via_batch(url, a)
                ),
                f"service POST /v1/reward ×{args.samples} ({args.workers} workers)": lambda a: asyncio.run(
                    via_singles(url, a)
                ),
            }
            rates: dict[str, float] = {}
            agree: dict[str, float] = {}
            reference: list[float] = []
            for name, fn in track(list(contenders.items()), description="measuring", console=console):
                fn(warm)
                rates[name], rewards = timed(fn, rounds)
                reference = reference or rewards
                agree[name] = sum(x == y for x, y in zip(rewards, reference, strict=True)) / len(rewards)
        finally:
            child.stop()

    base = next(iter(rates.values()))
    table = Table(title=f"math reward on {args.samples} typical answers × {args.rounds} rounds")
    for col in ("path", "samples/s", "ratio vs math-verify direct", "same rewards"):
        table.add_column(col, justify="right" if col != "path" else "left")
    for name, rate in rates.items():
        table.add_row(name, f"{rate:,.0f}", f"{rate / base:.2f}×", f"{agree[name]:.0%}")
    console.print(table)
    correct = sum(reference) / len(reference)
    console.print(f"share of right answers in the last round: {correct:.0%}")


if __name__ == "__main__":
    main()
