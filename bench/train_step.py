"""Training-step throughput of the Megatron backend: variants of the step vs a plain HF step, same run.

The vime side is the trainer's own code: a `TrainRank` (Megatron-core, SDPA attention, chunked
vocab-parallel log-probs, DDP + Megatron Adam, bf16 on GPU) built from the run config and training
one GRPO rollout per call (seed steps 37–41, old log-probs reused), in this process on one device
(no Ray hand-off). Each ``--variant`` is a name and config overrides (``key=value``, dotted for
``trainer.*``), so every option is compared through the same config path a run uses, each on a
fresh rank from the same weights. The baseline, measured first on the same device, is
transformers' model (SDPA, same dtype) + torch AdamW doing the same policy loss over the fixed
split's right-padded micro-batches, one optimizer step.

Response lengths follow ``--lengths``: ``fixed`` (all ``--response-len``), ``uniform`` (1 to
``--response-len``) or ``capped`` (exponential with mean ≈ ``--response-len``/1.5, about a fifth
truncated at the cap, as RL rollouts are), seeded; the distribution is printed. Per variant:
step time (median of ``--steps`` after one warm-up), tokens/s and MFU over real tokens
(6·N·tokens + causal attention per sample, against ``--peak-tflops``), the ratio to the baseline,
peak memory, padding waste (slots processed vs real tokens), the first step's loss, entropy and
grad norm (the same weights and samples for every variant: they must agree to bf16 noise), and,
with ``--sleep-check``, the first variant's memory after ``sleep()``. ``--profile [DIR]`` profiles
one more step of the first variant (or of ``--profile-variants``) with torch.profiler
(bench/profile_step.py: time by category, as a table and JSON).

    # GPU (one H200): Qwen3-0.6B shape, today's padded path vs packed + token budget, profiled
    python bench/train_step.py --shape 0.6b --samples 64 --prompt-len 200 --response-len 800 \\
        --lengths capped --micro-batch 4 --steps 3 --profile prof_06b --sleep-check \\
        --variant padded --variant "budget16k trainer.packed_sequences=true max_tokens_per_gpu=16384"
    # CPU sanity check
    python bench/train_step.py --shape micro --samples 8 --prompt-len 16 --response-len 48 --steps 2 \\
        --lengths uniform --variant padded --variant "packed trainer.packed_sequences=true" --profile prof_cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_common import bench_batch, emit, sample_flops, split_batch
from profile_step import print_breakdown, profile_step
from rich.console import Console
from rich.table import Table

from vime import procs
from vime.batch import RankBatch
from vime.config import RunConfig, load_config
from vime.models.tiny import QWEN3_SHAPES, SHAPES, TinyShape, build_tiny_qwen3, num_parameters

console = Console(width=160)
QWEN3 = {name.removeprefix("qwen3-"): shape for name, shape in QWEN3_SHAPES.items()}
"""Real Qwen3 shapes (random weights) by size: ``--shape 0.6b``."""


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: list[str]


def parse_variant(text: str) -> Variant:
    """``"name key=value key=value"`` (overrides as ``--set`` takes them)."""
    name, *overrides = shlex.split(text)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise argparse.ArgumentTypeError(f"variant {name!r}: overrides must be key=value, got {bad}")
    return Variant(name, overrides)


def response_lengths(kind: str, samples: int, cap: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    if kind == "fixed":
        return [cap] * samples
    if kind == "uniform":
        return rng.integers(1, cap + 1, size=samples).tolist()
    return np.minimum(cap, 1 + rng.exponential(cap / 1.5, size=samples).astype(int)).tolist()  # capped


def describe(lengths: list[int], cap: int) -> dict[str, Any]:
    q = np.percentile(lengths, [0, 25, 50, 75, 100]).astype(int).tolist()
    return {
        "min_p25_median_p75_max": q,
        "mean": round(float(np.mean(lengths)), 1),
        "at_cap": round(float(np.mean(np.asarray(lengths) == cap)), 3),
    }


def config(args: argparse.Namespace, work: Path, overrides: list[str]) -> RunConfig:
    base = {
        "rollout_batch_size": args.samples,
        "n_samples_per_prompt": 1,
        "micro_batch_size": args.micro_batch,
        "tensor_model_parallel_size": 1,
        "actor_num_gpus_per_node": args.gpus,
        "actor_num_cpu_ranks": 1,
        "rollout_num_gpus": 0,
        "colocate": False,
        "rollout_max_prompt_len": args.prompt_len,
        "rollout_max_response_len": args.response_len,
        "rollout_max_context_len": args.prompt_len + args.response_len,
        "trainer": {"lr": 1e-6, "checkpoint_dir": str(work / "ckpt"), "bf16": args.gpus > 0},
    }
    return load_config(base=base, environ={}, overrides=overrides)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_baseline(path: Path, rb: RankBatch, args: argparse.Namespace) -> dict[str, Any]:
    """transformers model + AdamW: the same loss over the same right-padded micro-batches, one step."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if args.gpus else "cpu"
    dtype = torch.bfloat16 if args.gpus else torch.float32
    if not args.gpus:
        torch.set_num_threads(1)  # as many threads as a CPU training rank gets
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").to(
        device
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.98), fused=bool(args.gpus))
    batches, real, padded = [], 0, 0
    for start, end in rb.micro_batches:
        rows = [rb.sample(i) for i in range(start, end)]
        s = max(len(r.tokens) for r in rows)
        ids = torch.zeros(len(rows), s, dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, : len(r.tokens)] = torch.as_tensor(r.tokens)
        pos = [torch.arange(r.prompt_length - 1, len(r.tokens) - 1) for r in rows]
        row = torch.cat([torch.full((len(p),), j) for j, p in enumerate(pos)])
        at = torch.cat(pos)
        adv = torch.cat([torch.full((len(p),), r.advantage) for p, r in zip(pos, rows, strict=True)])
        weight = torch.cat([torch.full((len(p),), 1.0 / len(p)) for p in pos]) / rb.num_samples
        batches.append([t.to(device) for t in (ids, row, at, adv, weight)])
        real += sum(len(r.tokens) for r in rows)
        padded += ids.numel()
    times = []
    if args.gpus:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps + 1):
        _sync()
        t0 = time.perf_counter()
        for ids, row, at, adv, weight in batches:
            logits = model(ids).logits[row, at].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[row, at + 1].unsqueeze(-1)).squeeze(-1)
            loss = (-(lp - lp.detach()).exp() * adv * weight).sum()
            loss.backward()
            del logits, lp
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.gpus else None
    del model, opt, batches
    gc.collect()
    if args.gpus:
        torch.cuda.empty_cache()
    return {
        "step_s": statistics.median(times[1:]),
        "peak_gib": peak,
        "real_tokens": real,
        "padded_tokens": padded,
    }


def profiled(args: argparse.Namespace, first: bool, variant: Variant) -> set[str]:
    chosen = {n for n in args.profile_variants.split(",") if n}
    return chosen or ({variant.name} if first else set())


def sleep_cycles(rank: Any, rb: RankBatch) -> dict[str, Any]:
    """Two sleep/wake cycles as the colocated loop runs them (the first allocates the pinned host
    buffers, the second reuses them: ``sleep_s`` / ``wake_s`` are what every later step pays), then
    a training step: its seconds against ``step_s`` show what the freed allocator cache costs. Then
    the same once without offload (``offload_train=false``: ``resident_*``, the state left on the
    device) and a step after it."""
    out: dict[str, Any] = {}
    for cycle in ("first_", ""):
        _sync()
        t0 = time.perf_counter()
        rank.sleep()
        out[f"{cycle}sleep_s"] = time.perf_counter() - t0
        out["memory_asleep"] = rank.memory_stats()
        t0 = time.perf_counter()
        rank.wake_up()
        out[f"{cycle}wake_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rank.train(rb)
    _sync()
    out["step_after_wake_s"] = time.perf_counter() - t0
    # offload_train=false: the optimizer state stays; does the next step run as fast?
    _sync()
    t0 = time.perf_counter()
    try:
        out["resident_memory"] = rank.sleep(offload=False)
    except MemoryError as exc:  # the state would not leave the engines their share: reported, not fatal
        out["resident_error"] = str(exc)
    out["resident_sleep_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rank.wake_up()
    out["resident_wake_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rank.train(rb)
    _sync()
    out["step_after_resident_wake_s"] = time.perf_counter() - t0
    return out


def run_variant(
    path: Path, cfg: RunConfig, rb: RankBatch, args: argparse.Namespace, variant: Variant, first: bool
) -> dict[str, Any]:
    """A fresh rank for ``cfg``: warm-up + timed steps, peak memory, padding, profile, sleep residual."""
    from vime_trainer.megatron.rank import TrainRank
    from vime_trainer.megatron.runtime import shutdown_rank

    out: dict[str, Any] = {"name": variant.name, "overrides": variant.overrides}
    rank = TrainRank(0, 1, cfg, str(path))
    try:
        rank.setup("127.0.0.1", procs.free_port())
        mbs = rank.steps.micro_batches(rb)
        out["micro_batches"] = len(mbs)
        out["real_tokens"] = sum(mb.real_tokens for mb in mbs)
        out["padded_tokens"] = sum(mb.padded_tokens for mb in mbs)
        out["largest_micro_batch_tokens"] = max(mb.padded_tokens for mb in mbs)
        out["micro_batch_tokens"] = [[mb.real_tokens, mb.padded_tokens] for mb in mbs]  # real, processed
        del mbs
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        times = []
        for step in range(args.steps + 1):
            rb.rollout_id = step
            _sync()
            t0 = time.perf_counter()
            metrics = rank.train(rb)
            _sync()
            times.append(time.perf_counter() - t0)
            if step == 0:
                out["first_step"] = {k: metrics[0].get(k) for k in ("loss", "entropy", "grad_norm")}
        out["step_s"] = statistics.median(times[1:])
        out["steps_s"] = [round(t, 4) for t in times]
        out["memory"] = rank.memory_stats()
        if args.profile and variant.name in profiled(args, first, variant):
            prof = profile_step(partial(rank.train, rb), Path(args.profile), variant.name, trace=args.trace)
            print_breakdown(console, f"profile: {args.shape}, {variant.name}", prof)
            out["profile"] = prof
        if first and args.sleep_check:
            out |= sleep_cycles(rank, rb)
    except Exception as exc:  # one failing variant (e.g. a kernel missing here) must not lose the others
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        console.print(f"[red]variant {variant.name} failed: {out['error']}[/red]")
    finally:
        rank.shutdown()
        shutdown_rank()  # also when setup failed half-way
        del rank
        torch._dynamo.reset()  # compiled variants' caches would keep their model alive
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="micro", choices=[*SHAPES, *QWEN3])
    ap.add_argument("--gpus", type=int, default=1 if torch.cuda.is_available() else 0, choices=[0, 1])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=48, help="the longest response (the cap)")
    ap.add_argument("--lengths", default="fixed", choices=["fixed", "uniform", "capped"])
    ap.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch of the fixed split")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (one more runs first as warm-up)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H200: 989)")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        help='"name key=value ..." (repeatable; default: one variant with the config defaults)',
    )
    ap.add_argument("--work", type=Path, help="where the result JSON and profiles go (the GPU suite's)")
    ap.add_argument(
        "--profile",
        type=Path,
        nargs="?",
        const=Path(),
        help="profile one step of the first variant into DIR (default: WORK/profile)",
    )
    ap.add_argument(
        "--profile-variants", default="", help="comma-separated variants to profile (default: the first)"
    )
    ap.add_argument("--sleep-check", action="store_true", help="memory after sleep() (first variant)")
    ap.add_argument("--trace", action="store_true", help="also write the gzipped chrome trace (large)")
    ap.add_argument("--json", type=Path, help="also write the result JSON here")
    args = ap.parse_args()
    if args.profile == Path():
        args.profile = (args.work or Path()) / "profile"
    if args.work and not args.json:
        args.json = args.work / "train_step.json"
    variants: list[Variant] = args.variant or [Variant("default", [])]
    shape = QWEN3.get(args.shape) or SHAPES[args.shape]
    lengths = response_lengths(args.lengths, args.samples, args.response_len)
    dist = describe(lengths, args.response_len)
    console.print(f"response lengths ({args.lengths}, cap {args.response_len}): {dist}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        console.print(f"building a random Qwen3 '{args.shape}' ({num_parameters(shape) / 1e6:.1f}M params)")
        path = build_tiny_qwen3(
            work / "model",
            args.shape if args.shape in SHAPES else "micro",
            shape=shape,
            dtype="bfloat16" if args.gpus else "float32",
            device="cuda" if args.gpus else "cpu",
        )
        batch = bench_batch(args.samples, args.prompt_len, args.response_len, shape.vocab_size, lengths)
        (fixed,) = split_batch(config(args, work, []), batch)
        baseline = None if args.skip_baseline else hf_baseline(path, fixed, args)
        results = []
        for i, v in enumerate(variants):
            cfg = config(args, work, v.overrides)
            (rb,) = split_batch(cfg, batch)
            results.append(run_variant(path, cfg, rb, args, v, first=i == 0))
    report(args, shape, [args.prompt_len + r for r in lengths], dist, baseline, results)


def report(
    args: argparse.Namespace,
    shape: TinyShape,
    lengths: list[int],
    dist: dict[str, Any],
    baseline: dict[str, Any] | None,
    results: list[dict[str, Any]],
) -> None:
    tokens = sum(lengths)
    flops = sample_flops(shape, lengths)
    peak = args.peak_tflops * 1e12
    table = Table(title=f"train step: {args.shape}, {tokens} real tokens/step ({args.lengths} lengths)")
    for col in (
        "side",
        "step s",
        "tokens/s",
        "MFU",
        "× baseline",
        "peak GiB",
        "padding",
        "mbs",
        "loss/entropy/gnorm",
    ):
        table.add_column(col)

    def waste(r: dict[str, Any]) -> str:
        return f"{1 - r['real_tokens'] / r['padded_tokens']:.1%}"

    if baseline:
        table.add_row(
            "baseline (HF + AdamW)",
            f"{baseline['step_s']:.3f}",
            f"{tokens / baseline['step_s']:,.0f}",
            f"{flops / baseline['step_s'] / peak:.1%}" if args.gpus else "n/a",
            "1.00×",
            f"{baseline['peak_gib']:.1f}" if baseline["peak_gib"] else "-",
            waste(baseline),
            "",
            "",
        )
    for r in results:
        if "error" in r:
            table.add_row(r["name"], "failed", r["error"][:60], *[""] * 6)
            continue
        step, first = r["step_s"], r["first_step"]
        if args.gpus:
            r["mfu"] = flops / step / peak
            r["peak_gib"] = r["memory"].get("peak_allocated_gib")
        r["tokens_per_s"] = tokens / step
        r["ratio_vs_baseline"] = baseline["step_s"] / step if baseline else None
        table.add_row(
            r["name"],
            f"{step:.3f}",
            f"{tokens / step:,.0f}",
            f"{r['mfu']:.1%}" if args.gpus else "n/a",
            f"{r['ratio_vs_baseline']:.2f}×" if baseline else "-",
            f"{r['peak_gib']:.1f}" if args.gpus else "-",
            waste(r),
            str(r["micro_batches"]),
            "/".join(f"{first[k]:.5g}" for k in ("loss", "entropy", "grad_norm")),
        )
    console.print(table)
    for r in results:
        if "memory_asleep" in r:
            console.print(
                f"{r['name']}: memory awake {r['memory']}, after sleep() {r['memory_asleep']}; sleep "
                f"{r['first_sleep_s']:.2f} s, then {r['sleep_s']:.3f} s (pinned buffers reused), wake "
                f"{r['wake_s']:.3f} s + a step {r['step_after_wake_s']:.3f} s (awake: {r['step_s']:.3f} s); "
                f"without offload: sleep {r['resident_sleep_s']:.3f} s, wake {r['resident_wake_s']:.3f} s + a "
                f"step {r['step_after_resident_wake_s']:.3f} s, {r.get('resident_error') or r.get('resident_memory')}"
            )
    result = {
        "shape": args.shape,
        "lengths": {"kind": args.lengths, "cap": args.response_len, "prompt": args.prompt_len, **dist},
        "real_tokens_per_step": tokens,
        "baseline": baseline,
        "variants": [{k: v for k, v in r.items() if k != "profile"} for r in results],
        "profiles": {r["name"]: r["profile"] for r in results if "profile" in r},
    }
    emit("train_step", **result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
