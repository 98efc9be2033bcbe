"""Reward service throughput for ``math`` on 256 typical answers, against math-verify in one process.

Baselines, measured in the same run on the same answers:
  * ``math-verify direct``: ``verify(parse(label), parse(response))`` in this process, one by one;
  * ``score_math in-process``: the service's own math function (boxed extraction + math-verify),
    called in this process: the work one worker does, without pool or HTTP.
Through the service (a real ``python -m vime_reward`` process on a free port), from one client
made before timing (a new client's SSL context alone costs tens of milliseconds):
  * ``POST /v1/rewards``: the 256 answers as one batch;
  * ``POST /v1/reward`` ×256: one call per sample, all in flight together (what the rollout does).
Each round uses fresh answers (math-verify caches parsed LaTeX), after a warm-up round.
The ratio column is samples/s divided by the first row's (the direct math-verify baseline's).

A second table scores the same answers with ``exact_match`` (the last ``\\boxed{}`` against the
label): a cheap function, so the service's per-sample overhead (pool tasks, pipes, HTTP) is what
it measures, against ``score_exact_match`` called in this process.

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


EXACT_OPTIONS = {"extract": "boxed"}


def exact_match_in_process(answers: list[Answer]) -> list[float]:
    from vime_reward.functions.qa import ExactMatchOptions, score_exact_match

    opts = ExactMatchOptions.model_validate(EXACT_OPTIONS)
    return [score_exact_match(resp, label, opts).reward for resp, label in answers]


async def via_batch(client: RewardClient, answers: list[Answer], fn: str = "math") -> list[float]:
    options = EXACT_OPTIONS if fn == "exact_match" else {}
    items = [{"response": r, "label": lab, "options": options} for r, lab in answers]
    return [r.reward for r in await client.score_batch(items, fn=fn)]


async def via_singles(client: RewardClient, answers: list[Answer], fn: str = "math") -> list[float]:
    options = EXACT_OPTIONS if fn == "exact_match" else {}
    results = await asyncio.gather(
        *(client.score({"response": r, "label": lab, "options": options}, fn=fn) for r, lab in answers)
    )
    return [r.reward for r in results]


class Service:
    """Calls to the service from one event loop and client, made once: a new client costs tens of
    milliseconds (its SSL context), which is no part of scoring."""

    def __init__(self, url: str) -> None:
        self.runner = asyncio.Runner()
        self.client = self.runner.run(self._client(url))

    @staticmethod
    async def _client(url: str) -> RewardClient:
        return RewardClient(url)

    def batch(self, fn: str) -> Callable[[list[Answer]], list[float]]:
        return lambda answers: self.runner.run(via_batch(self.client, answers, fn))

    def singles(self, fn: str) -> Callable[[list[Answer]], list[float]]:
        return lambda answers: self.runner.run(via_singles(self.client, answers, fn))

    def close(self) -> None:
        self.runner.run(self.client.aclose())
        self.runner.close()


def timed(fn: Callable[[list[Answer]], list[float]], rounds: list[list[Answer]]) -> tuple[float, list[float]]:
    """(samples per second over all rounds, the rewards of the last round)."""
    start = time.perf_counter()
    rewards: list[float] = []
    for answers in rounds:
        rewards = fn(answers)
    return sum(len(r) for r in rounds) / (time.perf_counter() - start), rewards


Contenders = dict[str, Callable[[list[Answer]], list[float]]]


def measure(
    contenders: Contenders, warm: list[Answer], rounds: list[list[Answer]], console: Console
) -> tuple[dict[str, float], dict[str, float], list[float]]:
    """(samples/s by name, share of rewards equal to the first contender's, its last-round rewards)."""
    rates: dict[str, float] = {}
    agree: dict[str, float] = {}
    reference: list[float] = []
    for name, fn in track(list(contenders.items()), description="measuring", console=console):
        fn(warm)
        rates[name], rewards = timed(fn, rounds)
        reference = reference or rewards
        agree[name] = sum(x == y for x, y in zip(rewards, reference, strict=True)) / len(rewards)
    return rates, agree, reference


def table(title: str, rates: dict[str, float], agree: dict[str, float]) -> Table:
    """Samples/s per contender, as a ratio of the first one's, and how often their rewards agree."""
    names = list(rates)
    out = Table(title=title)
    for col in ("path", "samples/s", f"ratio vs {names[0]}", "same rewards"):
        out.add_column(col, justify="right" if col != "path" else "left")
    for name, rate in rates.items():
        out.add_row(name, f"{rate:,.0f}", f"{rate / rates[names[0]]:.2f}×", f"{agree[name]:.0%}")
    return out


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
    workers = f"({args.workers} workers)"

    with tempfile.TemporaryDirectory() as tmp:
        port = procs.free_port()
        argv = procs.python_module(
            "vime_reward", "--port", str(port), "--set", f"reward.num_workers={args.workers}", "--insecure"
        )  # built-in functions only: no route it calls needs a token
        child = procs.start("reward", argv, log_path=Path(tmp) / "reward.log")
        url = f"http://127.0.0.1:{port}"
        try:
            procs.wait_healthy(url, child, timeout_s=120)
            service = Service(url)
            math: Contenders = {
                "math-verify direct (1 process)": direct_math_verify,
                "score_math in-process": score_math_in_process,
                f"service POST /v1/rewards {workers}": service.batch("math"),
                f"service POST /v1/reward ×{args.samples} {workers}": service.singles("math"),
            }
            exact: Contenders = {
                "exact_match in-process": exact_match_in_process,
                f"service POST /v1/rewards {workers}": service.batch("exact_match"),
                f"service POST /v1/reward ×{args.samples} {workers}": service.singles("exact_match"),
            }
            try:
                math_rates, math_agree, reference = measure(math, warm, rounds, console)
                exact_rates, exact_agree, _ = measure(exact, warm, rounds, console)
            finally:
                service.close()
        finally:
            child.stop()

    shape = f"{args.samples} typical answers × {args.rounds} rounds"
    console.print(table(f"math reward on {shape}", math_rates, math_agree))
    correct = sum(reference) / len(reference)
    console.print(f"share of right answers in the last round: {correct:.0%}")
    console.print(table(f"exact_match (boxed) reward on {shape}", exact_rates, exact_agree))


if __name__ == "__main__":
    main()
