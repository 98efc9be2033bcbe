"""Training-step throughput of the Megatron backend vs. a plain Hugging Face step, same run, same batch.

The vime side is the real path: `ActorGroup` ranks (Ray actors, Megatron-core, SDPA attention,
chunked vocab-parallel log-probs, DDP + Megatron Adam, bf16 on GPU) training one GRPO rollout per
call (seed steps 37–41, old log-probs reused). The baseline, measured first in this process on
the same device, is transformers' model (SDPA, same dtype) + torch AdamW doing the same policy
loss over the same micro-batches. Printed per side: step time (median), tokens/s (prompt +
response tokens per second), MFU (6·N·tokens + causal attention FLOPs against ``--peak-tflops``),
peak memory, and the ratio vime / baseline. The vime ranks' memory after ``sleep()`` is shown too.

The model is a random-init Qwen3 of the chosen shape, built locally (nothing downloaded).

    # GPU (one H200): Qwen3-0.6B shape, 64 samples × (200 prompt + 800 response) tokens, micro-batch 4
    python bench/train_step.py --shape 0.6b --gpus 1 --samples 64 --prompt-len 200 --response-len 800 \\
        --micro-batch 4 --steps 5
    # CPU sanity check
    python bench/train_step.py --shape micro --samples 8 --prompt-len 16 --response-len 48 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpu_common import bench_batch, split_batch, timed_steps, train_flops
from rich.console import Console
from rich.table import Table

from vime.batch import RankBatch, RolloutBatch
from vime.config import RunConfig, load_config
from vime.models.tiny import QWEN3_SHAPES, SHAPES, TinyShape, build_tiny_qwen3, num_parameters

console = Console()
QWEN3 = {name.removeprefix("qwen3-"): shape for name, shape in QWEN3_SHAPES.items()}
"""Real Qwen3 shapes (random weights) by size: ``--shape 0.6b``."""


def config(args: argparse.Namespace, work: Path) -> RunConfig:
    ranks = max(args.gpus, args.cpu_ranks)
    base = {
        "rollout_batch_size": args.samples,
        "n_samples_per_prompt": 1,
        "micro_batch_size": args.micro_batch,
        "tensor_model_parallel_size": args.tp,
        "actor_num_gpus_per_node": args.gpus,
        "actor_num_cpu_ranks": ranks,
        "rollout_num_gpus": 0,
        "colocate": False,
        "rollout_max_prompt_len": args.prompt_len,
        "rollout_max_response_len": args.response_len,
        "rollout_max_context_len": args.prompt_len + args.response_len,
        "trainer": {"lr": 1e-6, "checkpoint_dir": str(work / "ckpt"), "bf16": args.gpus > 0},
    }
    return load_config(base=base, environ={})


def hf_baseline(path: Path, batch: RolloutBatch, args: argparse.Namespace) -> dict[str, Any]:
    """transformers model + AdamW: the same loss over the same micro-batches, one optimizer step."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if args.gpus else "cpu"
    dtype = torch.bfloat16 if args.gpus else torch.float32
    if not args.gpus:
        torch.set_num_threads(1)  # as many threads as a CPU training rank gets
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").to(
        device
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.98), fused=bool(args.gpus))
    ids = torch.tensor(batch.tokens, dtype=torch.long).view(args.samples, -1).to(device)
    adv = torch.tensor(batch.advantages, device=device)
    p, r, mb = args.prompt_len, args.response_len, args.micro_batch
    times = []
    if args.gpus:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps + 1):
        _sync(args)
        t0 = time.perf_counter()
        for s in range(0, args.samples, mb):
            logits = model(ids[s : s + mb]).logits[:, p - 1 : p - 1 + r].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[s : s + mb, p:].unsqueeze(-1)).squeeze(-1)
            loss = (-(lp - lp.detach()).exp() * adv[s : s + mb, None]).mean(-1).sum() / args.samples
            loss.backward()
            del logits, lp
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(args)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.gpus else None
    del model, opt
    if args.gpus:
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times[1:]), "peak_gib": peak}


def _sync(args: argparse.Namespace) -> None:
    if args.gpus:
        torch.cuda.synchronize()


def vime_side(path: Path, cfg: RunConfig, rbs: list[RankBatch], args: argparse.Namespace) -> dict[str, Any]:
    from vime_trainer.megatron.actor_group import ActorGroup

    group = ActorGroup(cfg, str(path))
    t0 = time.perf_counter()
    group.start()
    started = time.perf_counter() - t0
    try:
        times, metrics = timed_steps(group, rbs, args.steps)
        awake = group.call("memory_stats")[0]
        t0 = time.perf_counter()
        group.sleep()
        sleep_s = time.perf_counter() - t0
        asleep = group.call("memory_stats")[0]
        t0 = time.perf_counter()
        group.wake_up()
        wake_s = time.perf_counter() - t0
    finally:
        group.shutdown()
    return {
        "step_s": statistics.median(times[1:]),
        "start_s": started,
        "metrics": metrics,
        "awake": awake,
        "asleep": asleep,
        "sleep_s": sleep_s,
        "wake_s": wake_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="micro", choices=[*SHAPES, *QWEN3])
    ap.add_argument("--gpus", type=int, default=1 if torch.cuda.is_available() else 0)
    ap.add_argument("--cpu-ranks", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=48)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (one more runs first as warm-up)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H200: 989)")
    ap.add_argument("--skip-baseline", action="store_true")
    args = ap.parse_args()
    shape = QWEN3.get(args.shape) or SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        console.print(
            f"building a random Qwen3 '{args.shape}' checkpoint ({num_parameters(shape) / 1e6:.1f}M params)"
        )
        path = build_tiny_qwen3(
            work / "model",
            args.shape if args.shape in SHAPES else "micro",
            shape=shape,
            dtype="bfloat16" if args.gpus else "float32",
        )
        cfg = config(args, work)
        batch = bench_batch(args.samples, args.prompt_len, args.response_len, shape.vocab_size)
        rbs = split_batch(cfg, batch)
        baseline = None if args.skip_baseline else hf_baseline(path, batch, args)
        vime = vime_side(path, cfg, rbs, args)
    report(args, shape, baseline, vime)


def report(
    args: argparse.Namespace, shape: TinyShape, baseline: dict[str, Any] | None, vime: dict[str, Any]
) -> None:
    tokens = args.samples * (args.prompt_len + args.response_len)
    flops = train_flops(shape, tokens, args.prompt_len + args.response_len)
    devices = max(args.gpus, 1)
    peak = args.peak_tflops * 1e12 * devices if args.gpus else float("nan")
    rows = {"vime (Megatron)": vime["step_s"]}
    if baseline:
        rows["baseline (HF + AdamW)"] = baseline["step_s"]
    table = Table(
        title=f"train step: {args.shape}, {tokens} tokens/step, {devices} {'GPU' if args.gpus else 'CPU rank'}(s)"
    )
    for col in ("side", "step s", "tokens/s", "MFU", "ratio vs baseline"):
        table.add_column(col)
    for name, step in rows.items():
        ratio = f"{baseline['step_s'] / step:.2f}×" if baseline else "-"
        mfu = flops / step / peak if args.gpus else float("nan")
        table.add_row(
            name, f"{step:.3f}", f"{tokens / step:,.0f}", f"{mfu:.1%}" if args.gpus else "n/a", ratio
        )
    console.print(table)
    console.print(
        f"vime memory awake {vime['awake']}, asleep {vime['asleep']}; sleep {vime['sleep_s']:.2f} s, "
        f"wake {vime['wake_s']:.2f} s; ranks started in {vime['start_s']:.1f} s"
    )
    result = {
        "shape": args.shape,
        "tokens_per_step": tokens,
        "vime_step_s": vime["step_s"],
        "vime_tokens_per_s": tokens / vime["step_s"],
        "vime_mfu": flops / vime["step_s"] / peak if args.gpus else None,
        "baseline_step_s": baseline["step_s"] if baseline else None,
        "ratio_vs_baseline": baseline["step_s"] / vime["step_s"] if baseline else None,
        "baseline_peak_gib": baseline["peak_gib"] if baseline else None,
        "memory_awake": vime["awake"],
        "memory_asleep": vime["asleep"],
        "last_metrics": vime["metrics"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
