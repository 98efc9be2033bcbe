"""Shared pieces of the GPU benchmarks (`weight_sync.py`, `rollout_gpu.py`, `step_gpu.py`).

- `emit`: the ``VIME_RESULT {...}`` line the GPU suite collects into ``results.json``;
- `bench_model`: a random Qwen3 of a kit or real Qwen3 shape with a tokenizer that decodes every id
  and a peaked output layer (`vime.models.tiny`), bf16 on the GPU;
- `start_engine` / `wait_engine`: one engine started with the rollout manager's own command builder
  (seed step 2), i.e. exactly the ``vllm serve`` line production runs;
- `bench_batch` / `split_batch` / `timed_steps` / `train_flops`: a random training batch, its DP
  split, timed GRPO steps on started trainer ranks, and their FLOPs (`train_step.py` uses them too);
- `train_steps`: all of that at once, with MFU;
- `manager_payloads` / `direct_round` / `gap_parts`: the rollout manager's own generate requests,
  sent straight to the engines (the "direct" side of a rollout comparison; `rollout_overhead.py`
  uses them too), and where a rollout's extra time over it goes;
- `write_prompts`: prompt files.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from vime import procs
from vime.config import RunConfig
from vime.models.tiny import TinyShape, build_tiny_qwen3, num_parameters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support (`timed_steps`)

console = Console(width=160)  # logs on the GPU machine are files: no terminal width
LOGIT_SCALE = 5.0
"""Output layer × 5: peaked next-token distributions, so greedy checks are not decided by bf16 noise."""


def emit(name: str, **data: Any) -> None:
    print("VIME_RESULT " + json.dumps({"name": name, **data}, default=str), flush=True)


def bench_model(out: Path, size: str, *, gpu: bool, weights: bool = True) -> Path:
    return build_tiny_qwen3(
        out,
        size,
        dtype="bfloat16" if gpu else "float32",
        fill_vocab=True,
        logit_scale=LOGIT_SCALE,
        weights=weights,
    )


def start_engine(cfg: RunConfig, model: Path, served_name: str, logs: Path) -> tuple[procs.Child, str]:
    """Engine 0 of ``cfg`` (vLLM on GPU 0, or a reference engine), not yet waited for."""
    from vime_rollout.engines.commands import engine_command
    from vime_rollout.engines.spec import plan_engines

    spec = plan_engines(cfg, gpus=list(range(cfg.rollout_num_gpus)))[0]
    command = engine_command(cfg, spec, str(model), served_name)
    child = procs.start(spec.name, command.argv, log_path=logs / f"{spec.name}.log", env=command.env)
    return child, spec.url


def wait_engine(child: procs.Child, url: str, timeout_s: float = 600.0) -> None:
    try:
        procs.wait_healthy(url, child, timeout_s=timeout_s, interval_s=0.5)
    except BaseException:
        child.stop(grace_s=10)
        raise


def bench_batch(
    samples: int, prompt_len: int, response_len: int, vocab: int, response_lengths: list[int] | None = None
) -> Any:
    """A `RolloutBatch` of ``samples`` random samples (groups of 8, rewards alternating 0/1, the
    seed's ±0.9354 advantages): prompts of ``prompt_len`` tokens, responses of ``response_len``
    tokens or of the given ``response_lengths``."""
    import numpy as np

    from vime.batch import RolloutBatch
    from vime.types import Sample, SampleStatus

    rng = np.random.default_rng(0)
    p, lengths = prompt_len, response_lengths or [response_len] * samples
    rows = [
        Sample(
            tokens=rng.integers(3, vocab, size=p + r).tolist(),
            response_length=r,
            loss_mask=[1] * r,
            reward=float(i % 2),
            status=SampleStatus.COMPLETED,
            index=i,
            group_index=i // 8,
        )
        for i, r in enumerate(lengths)
    ]
    adv = [0.9354 if i % 2 else -0.9354 for i in range(samples)]
    return RolloutBatch.from_samples(
        rows, batch_id="bench", run_id="bench", rollout_id=0, weight_version=1, advantages=adv
    )


def split_batch(cfg: RunConfig, batch: Any) -> list[Any]:
    """The batch's share per DP rank, as the rollout manager splits it (seed step 31)."""
    from vime.algorithms import build_dp_schedule
    from vime.batch import split_by_dp

    lengths = batch.total_lengths().tolist()
    gbs = cfg.global_batch_size or batch.num_samples
    schedule = build_dp_schedule(lengths, gbs, cfg.micro_batch_size, cfg.dp_size, cfg.max_tokens_per_gpu)
    return split_by_dp(batch, schedule)


def train_batches(args: argparse.Namespace, cfg: RunConfig, vocab: int) -> list[Any]:
    """``args.train_samples`` random samples (`bench_batch`) per DP rank."""
    return split_batch(cfg, bench_batch(args.train_samples, args.prompt_len, args.response_len, vocab))


def timed_steps(group: Any, rbs: list[Any], steps: int) -> tuple[list[float], dict[str, Any]]:
    """``steps`` GRPO steps, one more first (the warm-up), on started ranks that read each step's
    batch from a private Redis as in a run (published before the clock starts): the seconds of
    each (warm-up included) and the last step's metrics."""
    from tests.support.megatron import Publisher

    times, metrics = [], {}
    with tempfile.TemporaryDirectory() as data:
        port = procs.free_port()
        redis = procs.start_redis(port, data, appendonly=False)
        try:
            publish = Publisher(f"redis://127.0.0.1:{port}/0")
            for step in range(steps + 1):
                for rb in rbs:
                    rb.rollout_id = step
                ref = publish(rbs)
                t0 = time.perf_counter()
                metrics = group.train(ref).steps[0]
                times.append(time.perf_counter() - t0)
        finally:
            redis.stop()
    return times, metrics


def train_flops(shape: TinyShape, tokens: int, seq: int) -> float:
    """Training FLOPs: 6·N per token plus causal attention (6·L·heads·head_dim·seq per token)."""
    attn = 6 * shape.num_hidden_layers * shape.num_attention_heads * shape.head_dim * seq
    return float(6 * num_parameters(shape) * tokens + attn * tokens)


def sample_flops(shape: TinyShape, lengths: list[int]) -> float:
    """`train_flops` summed over samples of the given lengths (padding is not useful work)."""
    return sum(train_flops(shape, n, n) for n in lengths)


def train_steps(group: Any, args: argparse.Namespace, shape: TinyShape, on_gpu: bool) -> dict[str, Any]:
    """``args.train_steps`` GRPO steps (one more first, untimed) on started ranks: step time and MFU."""
    rbs = train_batches(args, group.config, shape.vocab_size)
    seq = args.prompt_len + args.response_len
    tokens = args.train_samples * seq
    times, metrics = timed_steps(group, rbs, args.train_steps)
    step_s = statistics.median(times[1:] or times)  # one step only: it includes the warm-up
    mfu = train_flops(shape, tokens, seq) / step_s / (args.peak_tflops * 1e12) if on_gpu else None
    shown = "n/a (CPU)" if mfu is None else f"{mfu:.1%}"
    console.print(f"train: {tokens} tokens/step in {step_s:.3f}s = {tokens / step_s:,.0f} tok/s, MFU {shown}")
    return {
        "tokens_per_step": tokens,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s),
        "mfu": None if mfu is None else round(mfu, 4),
        "steps_s": [round(t, 4) for t in times],
        "memory": group.call("memory_stats")[0],
        "last_metrics": metrics,
    }


# --- rollouts: the manager's requests, sent straight to the engines ----------------------------


def write_prompts(path: Path, count: int, length: int, seed: int = 0) -> Path:
    """``count`` prompts of ``length`` printable characters (``length`` tokens with the kit tokenizer)."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + " +-*/=()"
    lines = [
        json.dumps({"prompt": "".join(rng.choices(alphabet, k=length)), "label": "x"}) for _ in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def manager_payloads(
    cfg: RunConfig, model: Path, *, logprobs: int | None, evaluation: bool = False
) -> list[dict[str, Any]]:
    """The generate requests the rollout manager sends for one rollout (training or eval), in order."""
    from vime_rollout.data import DataSource
    from vime_rollout.factory import build_datasets
    from vime_rollout.model import load_tokenizer, served_model_name
    from vime_rollout.rollout.generate import request_payload
    from vime_rollout.rollout.state import GenerateState, SamplingSettings

    tok = load_tokenizer(model)
    train, evals = build_datasets(cfg, tok)
    if evaluation:
        groups = [
            g
            for ds in evals.values()
            for g in DataSource(ds, cfg.data.n_samples_per_eval_prompt, shuffle=False).get_samples(len(ds))
        ]
        sampling = SamplingSettings.for_eval(cfg)
    else:
        source = DataSource(train, cfg.n_samples_per_prompt, shuffle=False)
        groups = source.get_samples(cfg.rollout_batch_size)
        sampling = SamplingSettings.for_training(cfg)

    class _Unused:
        async def score(self, samples: list[Any]) -> list[Any]:
            return []

        async def generate(self, payload: dict[str, Any], *, session_id: str | None = None) -> dict[str, Any]:
            return {}

    state = GenerateState(
        cfg=cfg,
        tokenizer=tok,
        generator=_Unused(),
        scorer=_Unused(),
        model_name=served_model_name(cfg, model),
        sampling=sampling,
        concurrency=1,
        weight_version=lambda: 0,
    )
    return [request_payload(state, s, sampling.max_new_tokens, logprobs) for g in groups for s in g]


async def direct_round(
    urls: list[str],
    payloads: list[dict[str, Any]],
    concurrency: int,
    replies: list[float] | None = None,
    path: str | None = None,
) -> tuple[int, float]:
    """All payloads straight to the engines (round-robin, ``concurrency`` in flight) with the HTTP
    client the manager uses towards the router, to vLLM's generate route (or ``path``); (generated
    tokens, seconds). ``replies`` gets the time of each reply from the start, as the rollout's
    ``rollout/t_*_response_s``."""
    from vime.clients.router import RouterDataClient
    from vime.service import freeze_heap
    from vime.wire.vllm import GENERATE_PATH

    path = path or GENERATE_PATH
    # What the bench holds so far out of the collector's scans, as every vime service freezes its
    # start-up heap: a full collection inside the round (176 ms seen on CPU) would slow the baseline.
    freeze_heap()
    sem = asyncio.Semaphore(concurrency)
    clients = [RouterDataClient(u, timeout_s=1800) for u in urls]
    targets = itertools.cycle(clients)

    async def one(payload: dict[str, Any], client: RouterDataClient) -> int:
        async with sem:
            out = await client.post(path, payload)
            if replies is not None:
                replies.append(time.perf_counter() - t0)
            return len(out["choices"][0]["token_ids"])

    t0 = time.perf_counter()
    try:
        tokens = await asyncio.gather(*(one(p, next(targets)) for p in payloads))
        return sum(tokens), time.perf_counter() - t0
    finally:
        for c in clients:
            await c.aclose()


def gap_parts(
    metrics: dict[str, float], e2e_s: float, direct_s: float, direct_replies: list[float]
) -> dict[str, float]:
    """Where a rollout's time beyond a direct round of the same requests goes (seconds), from the
    rollout's own ``rollout/t_*_s`` metrics: before the first send, replies landing later than
    direct ones (router, engine), rewards after the last reply, the loop's end (abort), the engines'
    counters, batch build and publish, and what is left (HTTP, the job, the client)."""

    def t(name: str) -> float:
        return float(metrics.get(f"rollout/t_{name}_s", 0.0))

    wall = float(metrics.get("rollout/wall_s", 0.0))
    around = t("engine_metrics") + t("build") + t("publish")
    parts = {
        "total": e2e_s - direct_s,
        "before_first_request": t("first_request"),
        "send_spread": t("last_request") - t("first_request"),
        "first_reply_later": t("first_response") - t("first_request") - min(direct_replies, default=0.0),
        "last_reply_later": t("last_response") - t("first_request") - max(direct_replies, default=direct_s),
        "reward_tail": t("reward_tail"),
        "after_last_group": wall - t("last_group"),
        "engine_metrics": t("engine_metrics"),
        "build": t("build"),
        "publish": t("publish"),
        "outside_the_job": e2e_s - wall - around,
    }
    return {k: round(v, 4) for k, v in parts.items()}


# --- weight-sync rounds -----------------------------------------------------------------------


def sync_table(title: str, rounds: list[dict[str, Any]]) -> None:
    table = Table(title=title)
    for col in [
        "round",
        "buckets",
        "GB",
        "pause→resume s",
        "GB/s",
        "update s",
        "baseline",
        "baseline s",
        "push / baseline",
    ]:
        table.add_column(col, justify="right")
    for i, r in enumerate(rounds):
        if "error" in r:
            table.add_row(str(i), "failed", r["error"][:60])
            continue
        table.add_row(
            str(i),
            str(r["buckets"]),
            f"{r['bytes'] / 1e9:.2f}",
            f"{r['sync_s']:.3f}",
            f"{r['bytes'] / r['sync_s'] / 1e9:.1f}",
            f"{r['phases'].get('update', 0):.3f}",
            r["baseline"],
            f"{r['baseline_s']:.4f}",
            f"{r['sync_s'] / r['baseline_s']:.1f}",
        )
    console.print(table)


def sync_summary(all_rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds that went through (a failed round has ``error`` instead of figures)."""
    rounds = [r for r in all_rounds if "error" not in r]
    failed = len(all_rounds) - len(rounds)
    if not rounds:
        return {"failed_rounds": failed, "rounds": all_rounds} if all_rounds else {}
    sync = statistics.median(r["sync_s"] for r in rounds)
    base = statistics.median(r["baseline_s"] for r in rounds)
    nbytes = rounds[0]["bytes"]
    return {
        "median_sync_s": round(sync, 4),
        "GBps": round(nbytes / sync / 1e9, 2),
        "baseline": rounds[0]["baseline"],
        "median_baseline_s": round(base, 5),
        "baseline_GBps": round(nbytes / base / 1e9, 1),
        "push_over_baseline": round(sync / base, 1),
        "median_phases_s": {
            k: round(statistics.median(r["phases"].get(k, 0.0) for r in rounds), 4)
            for k in rounds[0]["phases"]
        },
        "failed_rounds": failed,
        "rounds": all_rounds,
    }


def sync_round(rep: Any, baseline: str, baseline_s: float, **extra: Any) -> dict[str, Any]:
    phases = {k: round(v, 4) for k, v in rep.phases.items()}
    return {
        "buckets": rep.buckets,
        "bytes": rep.nbytes,
        "sync_s": rep.seconds,
        "phases": phases,
        "update_parts": {k: round(v, 4) for k, v in rep.update_parts.items()},
        "baseline": baseline,
        "baseline_s": baseline_s,
        **extra,
    }
