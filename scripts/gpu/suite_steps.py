"""The steps of the GPU suite (`suite.py`): what each runs on the GPU and in the CPU dry run.

Each step is one command run from the repository root. ``expect_s`` is what it took (or is
estimated to take) on one H200 with the bundle installed, ``timeout_s`` its hard limit; the driver
also cuts a step's limit to what is left of the call's budget. Steps are independent: any subset
runs in any order, in one call.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Step:
    name: str
    doc: str
    gpu: list[str]
    dry: list[str]
    timeout_s: float
    expect_s: float
    pytest: bool = False
    work_arg: bool = True
    """Benches: pass ``--work DIR`` so their logs land where the driver collects them."""
    env: dict[str, str] = field(default_factory=dict)


def _pytest_step(
    name: str, doc: str, *paths: str, timeout_s: float, expect_s: float, env: dict[str, str] | None = None
) -> Step:
    """Tests run alike on the GPU and in the dry run (each picks its CPU stand-ins without a GPU)."""
    args = ["-m", "pytest", *paths]
    return Step(
        name, doc, args, list(args), timeout_s=timeout_s, expect_s=expect_s, pytest=True, env=dict(env or {})
    )


def _args(text: str) -> list[str]:
    return shlex.split(text)


def _variants(variants: list[str]) -> list[str]:
    return [a for v in variants for a in ("--variant", v)]


_PACKED = "trainer.packed_sequences=true"
TRAIN_VARIANTS_06B = [
    "padded",  # right-padded micro-batches of 4 samples (packed at 4 per micro-batch: 0.94x HF, left out)
    f"budget16k {_PACKED} max_tokens_per_gpu=16384",
    f"budget32k {_PACKED} max_tokens_per_gpu=32768",
    f"budget32k_bf16_grads {_PACKED} max_tokens_per_gpu=32768 trainer.grad_reduce_in_fp32=false",
    f"budget64k {_PACKED} max_tokens_per_gpu=65536",
]
"""Bench variants of the step (bench/train_step.py ``--variant``)."""
TRAIN_VARIANTS_4B = [
    # 16k ran out of memory; the padded step (3.8 s, 22.7 % MFU on 12-03) left out: the goal is MFU
    f"budget8k {_PACKED} max_tokens_per_gpu=8192",
    f"budget8k_torch_norm {_PACKED} max_tokens_per_gpu=8192 trainer.fused_norm=false",
]
TRAIN_VARIANTS_CPU = [
    "padded",
    f"packed {_PACKED}",
    f"budget {_PACKED} max_tokens_per_gpu=160",
    f"budget_recompute {_PACKED} max_tokens_per_gpu=160 trainer.recompute_activations=true",
]


_STEP_GPU = _args(
    "bench/step_gpu.py --engine vllm --size qwen3-0.6b --prompts 32 --n 8 --response-len 1024 --rollouts 2"
) + _args(f"--set {_PACKED} --set max_tokens_per_gpu=32768")
"""bench_step's workload (packed 32k budgets), two rollouts a run; ``--runs`` says which runs."""
_STEP_CPU = _args(
    "bench/step_gpu.py --engine reference --size micro --prompts 4 --n 4 --response-len 16 --rollouts 2"
)
"""Its CPU stand-in."""

_ASYNC_RESULTS = "--results /tmp/vime-bench-async.json"
"""Where bench_async_sync leaves its result for bench_async, a later call on the same machine."""
_ASYNC_GPU = _args(
    "--engine vllm --size qwen3-0.6b --prompts 32 --n 8 --response-len 1024 --rollouts 3"
) + _args(f"--set {_PACKED} --set max_tokens_per_gpu=16384 {_ASYNC_RESULTS}")
"""16k budgets: the async trainer's share of an H100 ran out of memory at 32k on 12-06 (the 0.6B
step peaks at 31.3 GiB with 16k, 39.8 GiB with 32k), and at 16k too with 0.45 of the GPU (the
bench's shares are now 0.4 for vLLM and 0.5 for the trainer: both halves ran on an H100 on 12-06,
327 s and 258 s)."""
_ASYNC_CPU = _args(
    "--engine reference --size micro --prompts 4 --n 4 --response-len 16 --rollouts 3"
) + _args(_ASYNC_RESULTS)

STEPS: dict[str, Step] = {
    s.name: s
    for s in [
        _pytest_step(
            "contract",
            "the engine contract suite against real vllm serve (IPC pusher), started by the rollout manager's command builder",
            "tests/gpu/test_vllm_contract.py",
            timeout_s=300,
            expect_s=160,
        ),
        _pytest_step(
            "megatron",
            "Megatron logits vs HF within bf16 noise (TP=1; TP=2 on 2 GPUs) + the backend's own GPU test",
            "tests/gpu/test_megatron_logits.py",
            "tests/gpu/test_megatron_gpu.py",
            timeout_s=240,
            expect_s=135,  # 133 s on an H100 on 12-07
        ),
        _pytest_step(
            "loop",
            "the colocated loop, 3 rollouts, real vLLM + Megatron + IPC (engine.weight_load=auto: direct): versions, mismatch, memory order",
            "tests/gpu/test_colocated_loop.py",
            timeout_s=420,
            expect_s=240,
        ),
        _pytest_step(
            "loop_vllm",
            "the colocated loop with engine.weight_load=vllm: every push through vLLM's /update_weights",
            "tests/gpu/test_colocated_loop.py",
            timeout_s=420,
            expect_s=240,
            env={"VIME_GPU_WEIGHT_LOAD": "vllm"},
        ),
        _pytest_step(
            "direct",
            "the direct load across two processes over CUDA IPC staging buffers (checksums on the GPU)",
            "tests/gpu/test_direct_load.py",
            timeout_s=150,
            expect_s=40,
        ),
        Step(
            "bench_sync",
            "weight sync of a Qwen3-4B shape (8.8 GB) Megatron → vLLM through make_weight_sync, engine.weight_load vllm, direct in two 4.5 GiB buckets (direct@4608) and direct in 1 GiB and in 256 MiB buckets alternating (a sleeping trainer holds two buckets), the trainer awake and asleep as in vime train, vs a D2D copy; 4B train-step MFU",
            _args(
                "bench/weight_sync.py --transport ipc --size qwen3-4b --rounds 2 --asleep-rounds 2 --train-steps 2"
                " --weight-loads vllm direct@4608 direct direct@256"
            ),
            _args(
                "bench/weight_sync.py --transport shm --size micro --engines 1 --rounds 2 --train-steps 1"
                " --weight-loads vllm direct@1 direct"
            ),
            timeout_s=400,
            expect_s=220,
        ),
        Step(
            "bench_sync_lean",
            "bench_sync's 4B pushes in vime train's memory order (the trainer's state and the engine never awake together; fits an 80 GB H100): engine.weight_load vllm, direct (1 GiB buckets), direct@2048 and direct@4608, from the sleeping trainer, vs a D2D copy; no training steps",
            _args(
                "bench/weight_sync.py --transport ipc --size qwen3-4b --lean --rounds 0 --asleep-rounds 3"
                " --weight-loads vllm direct direct@2048 direct@4608 --set trainer.grad_reduce_in_fp32=false"
            ),
            _args(
                "bench/weight_sync.py --transport shm --size micro --engines 1 --lean --rounds 0"
                " --asleep-rounds 2 --weight-loads vllm direct@1 direct"
            ),
            timeout_s=460,
            expect_s=300,
        ),
        Step(
            "bench_step",
            "the full colocated step (Qwen3-0.6B shape, 32×8 samples, ≤1024 tokens): T_step and its parts, one run with engine.weight_load=direct then one with vllm",
            _STEP_GPU + _args("--runs direct vllm"),
            _STEP_CPU + _args("--runs direct vllm"),
            timeout_s=480,
            expect_s=380,  # 340 s on an H200 on 12-03, 378 s on an H100 on 12-07
        ),
        Step(
            "bench_step_order",
            "bench_step's workload three times on one stack: vllm, direct, vllm (is a later run on a stack slower whatever its settings? gpu_probe.py between the runs)",
            _STEP_GPU + _args("--runs vllm direct vllm"),
            _STEP_CPU + _args("--runs vllm direct vllm"),
            timeout_s=560,
            expect_s=480,
        ),
        Step(
            "bench_step_resident",
            "bench_step's workload twice on one stack, engine.weight_load=direct: the default (the trainer's state offloaded while vLLM generates), then offload_train=false (it stays on the GPU)",
            _STEP_GPU + _args("--runs direct direct,offload_train=false"),
            _STEP_CPU + _args("--runs direct direct,offload_train=false"),
            timeout_s=480,
            expect_s=360,
        ),
        Step(
            "bench_step_save",
            "bench_step's workload, engine.weight_load=direct, 3 rollouts with save_interval=1: what a checkpoint holds the loop when its files are written in the background (rollouts 0, 1) and when it waits (the last)",
            _STEP_GPU + _args("--runs direct --rollouts 3 --set save_interval=1"),
            _STEP_CPU + _args("--runs direct --rollouts 3 --set save_interval=1"),
            timeout_s=480,
            expect_s=330,
        ),
        Step(
            "bench_async_sync",
            "the synchronous colocated half of bench_async (Qwen3-0.6B shape, 32×8 samples, ≤1024 tokens, 16k budgets), kept for bench_async",
            _args("bench/async_gpu.py --modes sync") + _ASYNC_GPU,
            _args("bench/async_gpu.py --modes sync") + _ASYNC_CPU,
            timeout_s=480,
            expect_s=340,  # the stack's start ~160 s, 3 steps, the last one's checkpoint; a call of its own
        ),
        Step(
            "bench_async",
            "mode=async on one GPU against the kept bench_async_sync result (same workload): samples/s, their ratio (goal ≥ 1.5), the mismatch of each",
            _args("bench/async_gpu.py --modes async") + _ASYNC_GPU,
            _args("bench/async_gpu.py --modes async") + _ASYNC_CPU,
            timeout_s=480,
            expect_s=300,
        ),
        Step(
            "bench_rollout",
            "256 samples × 1024 tokens through rollout manager + router vs straight to vLLM, ± log-probs (direct also on the compact route), the gap by part",
            # three rounds (the order moved the ratio by 3-13 points between two rounds on 12-06; four
            # rounds ran out of 480 s on a slow H100), each with log-probs also on the compact route
            _args("bench/rollout_gpu.py --engine vllm --size qwen3-0.6b --samples 256 --max-tokens 1024")
            + _args("--rounds 3"),
            _args("bench/rollout_gpu.py --engine reference --size micro --samples 16 --max-tokens 16"),
            timeout_s=590,
            expect_s=500,  # vLLM's start 76-111 s, then 63-95 s a round on an H100 (4 rounds ran out of 480 s)
        ),
        _pytest_step(
            "train_kernels",
            "packed-sample attention (varlen, flex) against padded SDPA, compiled RoPE and SwiGLU against unfused, bf16, with gradients",
            "tests/unit/trainer/test_packed_attention.py",
            "tests/unit/trainer/test_fused_kernels.py",
            timeout_s=120,
            expect_s=40,
        ),
        Step(
            "bench_train",
            "Megatron train step variants vs HF + AdamW, Qwen3-0.6B shape, uneven lengths, profiled",
            _args(
                "bench/train_step.py --shape 0.6b --gpus 1 --samples 64 --prompt-len 200 --response-len 800"
            )
            + _args("--lengths capped --micro-batch 4 --steps 3 --sleep-check --profile")
            + _args("--profile-variants budget32k")
            + _variants(TRAIN_VARIANTS_06B),
            _args("bench/train_step.py --shape micro --samples 8 --prompt-len 16 --response-len 48 --steps 2")
            + _args("--lengths uniform --sleep-check --profile")
            + _variants(TRAIN_VARIANTS_CPU),
            timeout_s=420,
            expect_s=290,
        ),
        Step(
            "bench_train_4b",
            "Megatron train step variants, Qwen3-4B shape, uneven lengths, profiled (MFU)",
            _args("bench/train_step.py --shape 4b --gpus 1 --samples 48 --prompt-len 200 --response-len 824")
            + _args("--lengths capped --micro-batch 2 --steps 2 --skip-baseline --profile")
            + _args("--profile-variants budget8k")
            + _variants(TRAIN_VARIANTS_4B),
            _args("bench/train_step.py --shape micro --samples 8 --prompt-len 16 --response-len 48 --steps 1")
            + _args("--lengths capped --skip-baseline --profile")
            + _variants(TRAIN_VARIANTS_CPU[:2]),
            timeout_s=420,
            expect_s=90,  # 78 s on 12-06 (one variant)
        ),
    ]
}

GROUPS: dict[str, list[str]] = {
    "tests": ["loop", "contract", "megatron"],
    "benches": ["bench_sync", "bench_step"],
    "throughput": ["train_kernels", "bench_train_4b", "bench_train"],
    "weight_load": ["bench_sync", "direct", "loop_vllm"],
    "async": ["bench_async_sync", "bench_async"],
    "all": list(STEPS),
}
"""Named selections. What fitted one session's 30 device minutes on 12-03 (about 100 s of it for
the machine's start and the bundle's four parts): ``loop train_kernels bench_train_4b`` with
``install`` (~420 s), then ``bench_step`` (~340 s), ``bench_rollout`` (~330 s), ``bench_async_sync``
(~340 s) and ``bench_async`` (~300 s), one call each (each vLLM start alone takes 110–155 s). On
12-06 one H100 (~25 s to start, four parts ~10 s) took ``install`` + ``bench_train`` (193 s), then
``bench_async_sync`` (330), ``bench_async`` (261), ``bench_step`` (315), ``bench_rollout`` (225,
one round) and ``bench_train_4b`` (45: out of memory on 79 GiB), back to back: the machine goes back
after 30 s idle, so the calls follow each other without analysis between them. The most telling
step of a call goes first, so a call cut short loses the least. Later on 12-06 (H100):
``train_kernels megatron bench_train`` 284 s (six 0.6B variants), ``bench_step`` 305 s,
``bench_rollout`` 254 s (two rounds, the order swapped). Fifth 12-06 session (H100): ``megatron``
125 s, ``bench_step_resident`` over 300 s (two rollouts, vLLM's start 152 s on a cold machine),
``bench_step`` 374 s, ``bench_rollout`` past 480 s (four rounds at ~95 s each). Sixth (H100,
half the device time lost to machines that did not start): ``install`` + ``bench_rollout`` 355 s
(three rounds, vLLM's start 95 s), ``bench_step_resident`` 302 s (two runs of two rollouts)."""


class SelectionError(ValueError):
    """A step or group name the suite does not know."""


def select(names: list[str]) -> list[Step]:
    """Steps by name or group, in the order given, each once; nothing given is ``tests``."""
    chosen: list[str] = []
    for name in names or ["tests"]:
        expanded = GROUPS.get(name, [name])
        for step in expanded:
            if step not in STEPS:
                known = ", ".join([*STEPS, *GROUPS])
                raise SelectionError(f"unknown step {step!r}: choose from {known}")
            if step not in chosen:
                chosen.append(step)
    return [STEPS[n] for n in chosen]


def command(step: Step, *, dry: bool, work: Path, basetemp: Path, junit: Path) -> list[str]:
    """The argv of a step (this interpreter), with the per-step directories the driver collects."""
    argv = [sys.executable, *(step.dry if dry else step.gpu)]
    if step.pytest:
        argv += ["-q", "-s", "-rfEs", "-p", "no:cacheprovider", "-o", "addopts="]
        argv += [f"--basetemp={basetemp}", f"--junitxml={junit}"]
    elif step.work_arg:
        argv += ["--work", str(work)]
    return argv
