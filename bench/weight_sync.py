"""The trainer's weight push (seed steps 45–52), against the floor of moving the same bytes, measured
in the same run. Two transports:

``--transport shm`` (CPU, default): `ActorGroup` (Megatron ranks as Ray actors; rank 0 writes the HF
buckets as safetensors in ``--dir``) → `WeightSync` (pause, start, one ``/update_weights`` per
bucket to every engine concurrently, finish with the version, resume) → CPU reference engines.
Baseline: the same buckets written to the same directory and read back in this process.

``--transport ipc`` (GPU host, one GPU, vLLM installed): a real ``vllm serve`` started by the
rollout manager's command builder with dummy weights (``--load-format dummy``), and the trainer
ranks on the same GPU. Each round is the colocated flow of a step: engine ``/sleep?level=2`` →
engine ``/wake_up?tags=weights`` → IPC push → ``/wake_up?tags=kv_cache``, then the engine's greedy
next token must equal the trainer's for every probe prompt (and must not before the first push:
dummy weights). Two kinds of round:

- ``--rounds``: the trainer awake, the push reads its live GPU parameters — the transfer itself;
  baseline: device-to-device copies of the same bytes on the rank (one flat copy, and one clone
  per parameter), the floor of any GPU-to-GPU push;
- ``--cpu-rounds``: the seed's order, the trainer asleep first (step 41), so the push reads the
  CPU backup; baseline: the host→device copy of that backup.

Per round: pause→resume seconds (pause, flush, start, buckets, finish, resume), GB/s, phases,
baseline, push / baseline. Goal for a Qwen3-4B shape (8.8 GB): ≤ 0.1 s (vLLM's helper: 0.25–0.32 s).

``--train-steps N`` then trains N GRPO steps on the same ranks (engines asleep) and prints the
step time and MFU (6·N·tokens + causal attention against ``--peak-tflops``), so a 4B shape is
built and loaded once for both figures. ``--fast-rounds N`` then pushes the trained weights N
times with the opt-in fast loader (``vime_rollout.vllm_ext.fast_loader``, a vLLM worker extension
that copies the bytes straight into the parameters; the engine is started with it): the engine
must disagree with the trainer before (stale weights) and agree after every push. A failure of
the fast path is reported, not fatal to the stock figures. A final ``VIME_RESULT {...}`` line
has everything; the exit status is 1 when any check failed.

    python bench/weight_sync.py --transport ipc --size qwen3-4b --rounds 3 --cpu-rounds 2 --train-steps 3 \\
        --fast-rounds 2
    python bench/weight_sync.py [--transport shm] [--size micro|small] [--engines 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from gpu_common import (
    bench_model,
    console,
    emit,
    start_engine,
    sync_round,
    sync_summary,
    sync_table,
    train_steps,
    wait_engine,
)

from vime import procs
from vime.config import RunConfig, load_config
from vime.models.tiny import QWEN3_SHAPES, SHAPES, build_tiny_qwen3, shape_named
from vime.wire.rollout import EngineInfo

FAST_ARGS = ", --worker-extension-cls, vime_rollout.vllm_ext.fast_loader.FastWeightLoader"
PROMPTS = [[(7 * i + 13 * j) % 90 + 3 for j in range(8)] for i in range(8)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="shm", choices=("shm", "ipc"))
    p.add_argument("--size", default="small", choices=[*SHAPES, *QWEN3_SHAPES])
    p.add_argument("--engines", type=int, default=2, help="shm: reference engines")
    p.add_argument("--rounds", type=int, default=5, help="pushes (ipc: from the awake trainer's GPU weights)")
    p.add_argument(
        "--cpu-rounds", type=int, default=0, help="ipc: pushes from the sleeping trainer's CPU backup"
    )
    p.add_argument("--train-steps", type=int, default=0, help="then train this many steps (MFU)")
    p.add_argument(
        "--fast-rounds", type=int, default=0, help="ipc: then pushes with the fast loader (opt-in)"
    )
    p.add_argument("--train-samples", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--response-len", type=int, default=824)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H200: 989)")
    p.add_argument("--tp", type=int, default=1, help="shm: CPU trainer ranks (TP size)")
    p.add_argument("--bucket-mb", type=int, default=None, help="default: 1024 (ipc, the trainer's), 64 (shm)")
    p.add_argument("--unpacked", action="store_true", help="ipc: one handle per tensor")
    p.add_argument("--dir", type=Path, default=None, help="shm: bucket directory (default: /dev/shm)")
    p.add_argument("--work", type=Path, default=None, help="scratch and logs (default: a temp dir)")
    args = p.parse_args()
    if args.bucket_mb is None:
        args.bucket_mb = 1024 if args.transport == "ipc" else 64
    return args


def trainer_config(work: Path, args: argparse.Namespace, gpu: bool) -> RunConfig:
    ranks = (
        [
            "actor_num_gpus_per_node=1",
            "rollout_num_gpus=1",
            "rollout_num_gpus_per_engine=1",
            "engine.backend=vllm",
        ]
        if gpu
        else ["actor_num_gpus_per_node=0", "rollout_num_gpus=0", f"actor_num_cpu_ranks={args.tp}"]
    )
    samples = args.train_samples if args.train_steps or args.fast_rounds else 4
    return load_config(
        overrides=[
            *ranks,
            f"tensor_model_parallel_size={1 if gpu else args.tp}",
            f"rollout_batch_size={samples}",
            "n_samples_per_prompt=1",
            f"micro_batch_size={min(args.micro_batch, samples)}",
            "rollout_max_prompt_len=512",
            "rollout_max_response_len=512",
            "rollout_max_context_len=1024",
            "engine.gpu_memory_utilization=0.2",
            "engine.enforce_eager=true",
            f"engine.extra_args=[--load-format, dummy, --dtype, bfloat16{FAST_ARGS if args.fast_rounds else ''}]",
            "trainer.lr=0.001",  # training visibly changes the weights (the fast rounds' stale check)
            f"engine.base_port={procs.free_port()}",
            f"trainer.packed_buffer_size_bytes={args.bucket_mb << 20}",
            f"trainer.ipc_packed={not args.unpacked}",
            f"trainer.checkpoint_dir={work / 'ckpt'}",
        ],
        environ={},
    )


# --- shm (CPU) ------------------------------------------------------------------------------------


def start_reference_engines(model: Path, n: int, logs: Path) -> tuple[list[procs.Child], list[str]]:
    children, urls = [], []
    for k in range(n):
        port = procs.free_port()
        argv = procs.python_module(
            "vime_rollout.reference_engine", "--model", str(model), "--port", str(port), "--threads", "1"
        )
        children.append(procs.start(f"engine{k}", argv, log_path=logs / f"engine{k}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    for child, url in zip(children, urls, strict=True):
        procs.wait_healthy(url, child, timeout_s=180)
    return children, urls


def tmpfs_round_trip(group: Any, directory: str | None) -> float:
    """Write + read the same buckets in this process: the tmpfs floor."""
    import torch
    from vime_trainer.weights.bucket_files import read_bucket, write_bucket
    from vime_trainer.weights.buckets import pack_buckets

    tensors = [(n, torch.tensor(a)) for n, a in group.call("hf_state_dict")[0].items()]
    t0 = time.perf_counter()
    for bucket in pack_buckets(tensors, group.config.trainer.packed_buffer_size_bytes):
        path = write_bucket(bucket, directory, prefix="bench-baseline")
        read_bucket(path)
        path.unlink()
    return time.perf_counter() - t0


def run_shm(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from vime_trainer.megatron.actor_group import ActorGroup
    from vime_trainer.weight_sync import WeightSync
    from vime_trainer.weight_sync.shm_transport import ShmTransport

    model = build_tiny_qwen3(work / "model", args.size)
    directory = str(args.dir) if args.dir else None
    children, urls = start_reference_engines(model, args.engines, work / "logs")
    group = ActorGroup(trainer_config(work, args, gpu=False), str(model))
    try:
        group.start()
        sync = WeightSync(ShmTransport(group, directory))
        infos = [
            EngineInfo(index=i, url=u, backend="reference", status="ready", registered=True)
            for i, u in enumerate(urls)
        ]
        rounds = []
        for r in range(args.rounds):
            rep = asyncio.run(sync.push(infos, r + 1, flush=True))
            base = tmpfs_round_trip(group, directory)
            rounds.append(sync_round(rep, "tmpfs write+read", base))
        sync_table("shm push vs tmpfs round trip", rounds)
        train = train_steps(group, args, shape_named(args.size), on_gpu=False) if args.train_steps else None
        return {"shm": sync_summary(rounds), "train": train}
    finally:
        group.shutdown()
        for child in children:
            child.stop()


# --- ipc (GPU) ------------------------------------------------------------------------------------


def greedy_agrees(group: Any, url: str) -> bool:
    """The engine's greedy next token is the trainer's argmax, or within bf16 noise of it, for every prompt.

    bf16 noise scales with the logits: two bf16 implementations of a 4B model differ by ~1% of the
    largest logit (a fixed 0.05 flagged every correct push of the 4B shape on the H200), while
    stale or garbled weights pick tokens far below the trainer's maximum.
    """
    import numpy as np

    logits = next(x for x in group.call("logits", np.array(PROMPTS)) if x is not None)[:, -1, :]
    for prompt, row in zip(PROMPTS, logits, strict=True):
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1, "temperature": 0.0}}
        out = httpx.post(url + "/inference/v1/generate", json=body, timeout=60).json()
        noise = 0.05 + 0.02 * float(np.abs(row).max())
        if row[out["choices"][0]["token_ids"][0]] < row.max() - noise:
            return False
    return True


def device_copy_seconds(rank: Any) -> dict[str, float]:
    """Runs in the rank: the same bytes copied on the GPU (one flat copy; one clone per parameter)."""
    import torch

    params = [p.detach() for p in rank.passes.model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    out: dict[str, float] = {}
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(2):  # the second is the figure
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        out["flat"] = time.perf_counter() - t0
    del src, dst  # at most 2× the weights extra at any time
    for _ in range(2):  # the second is the figure (the first pays for allocation)
        t0 = time.perf_counter()
        clones = [p.clone() for p in params]
        torch.cuda.synchronize()
        out["clones"] = time.perf_counter() - t0
        del clones
    torch.cuda.empty_cache()
    return {**out, "bytes": float(nbytes)}


def host_to_device_seconds(rank: Any) -> float:
    """Runs in the rank: copy its CPU weight backup to the GPU (what the push reads while it sleeps)."""
    import torch

    backup = rank.backup.get("actor")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    copies = [t.to("cuda", non_blocking=True) for t in backup.values()]
    torch.cuda.synchronize()
    del copies
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


async def colocated_push(sync: Any, group: Any, url: str, version: int, trainer_sleeps: bool) -> Any:
    """Seed 33–36, (41), 43, 45–52, 54 on one GPU: engine sleeps, (trainer sleeps,) weights wake, push, KV wakes."""
    info = EngineInfo(index=0, url=url, backend="vllm", status="ready", registered=True, gpu_ids=[0])
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        if not (await http.get("/is_sleeping")).json().get("is_sleeping"):
            (await http.post("/sleep", params={"level": 2, "mode": "keep"})).raise_for_status()
        if trainer_sleeps:
            await asyncio.to_thread(group.sleep)
        t0 = time.perf_counter()
        (await http.post("/wake_up", params={"tags": "weights"})).raise_for_status()
        wake_weights = time.perf_counter() - t0
        rep = await sync.push([info], version, flush=True)
        t0 = time.perf_counter()
        (await http.post("/wake_up", params={"tags": "kv_cache"})).raise_for_status()
        wake_kv = time.perf_counter() - t0
    return rep, {"wake_weights_s": round(wake_weights, 4), "wake_kv_s": round(wake_kv, 4)}


class Rounds:
    """Pushes of one kind, each checked (greedy agreement) and timed against its baseline."""

    def __init__(self, group: Any, url: str) -> None:
        self.group, self.url, self.version = group, url, 0
        self.problems: list[str] = []
        self.d2d: dict[str, float] | None = None
        """Measured once (the same bytes every round): no extra GPU memory in later rounds."""

    def run(self, kind: str, sync: Any, count: int, trainer_sleeps: bool) -> list[dict[str, Any]]:
        from vime_trainer.weight_sync.ipc import call_on_ranks

        rounds = []
        for r in range(count):
            self.version += 1
            rep, wakes = asyncio.run(colocated_push(sync, self.group, self.url, self.version, trainer_sleeps))
            agrees = greedy_agrees(self.group, self.url)  # wakes the trainer again
            if not agrees:
                self.problems.append(
                    f"{kind} round {r}: after the push the engine disagrees with the trainer"
                )
            if trainer_sleeps:
                base = call_on_ranks(self.group, host_to_device_seconds)[0]
                rounds.append(sync_round(rep, "H2D copy", base, greedy_agrees=agrees, **wakes))
            else:
                d2d = self.d2d = self.d2d or call_on_ranks(self.group, device_copy_seconds)[0]
                clones = round(d2d["clones"], 5)
                rounds.append(
                    sync_round(
                        rep, "D2D flat copy", d2d["flat"], d2d_clones_s=clones, greedy_agrees=agrees, **wakes
                    )
                )
        return rounds


def ipc_rounds(args: argparse.Namespace, group: Any, url: str) -> tuple[dict[str, Any], Rounds]:
    from vime_trainer.weight_sync import WeightSync
    from vime_trainer.weight_sync.ipc import IpcTransport

    rounds = Rounds(group, url)
    if greedy_agrees(group, url):
        rounds.problems.append("the engine agrees with the trainer before any push (not dummy weights?)")
    sync = WeightSync(IpcTransport(group, packed=not args.unpacked))
    gpu = rounds.run("stock", sync, args.rounds, trainer_sleeps=False)
    cpu = rounds.run("stock from CPU backup", sync, args.cpu_rounds, trainer_sleeps=True)
    sync_table("IPC push from the awake trainer's GPU weights vs D2D copy", gpu)
    if cpu:
        sync_table("IPC push from the sleeping trainer's CPU backup (the seed's order) vs H2D copy", cpu)
    return {"from_gpu": sync_summary(gpu), "from_cpu_backup": sync_summary(cpu)}, rounds


def fast_rounds(args: argparse.Namespace, rounds: Rounds) -> dict[str, Any]:
    """The opt-in fast load (worker extension), after training changed the trainer's weights: the
    engine must disagree first (stale weights), then agree after every fast push."""
    from vime_trainer.weight_sync.fast_sync import FastIpcSync

    stale = not greedy_agrees(rounds.group, rounds.url)
    try:
        fast = rounds.run(
            "fast", FastIpcSync(rounds.group, args.bucket_mb << 20), args.fast_rounds, trainer_sleeps=False
        )
    except Exception as exc:  # the stock figures must still come out
        rounds.problems.append(f"fast load failed: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}", "engine_was_stale": stale}
    sync_table("fast load (worker extension) from the awake trainer's GPU weights vs D2D copy", fast)
    return {**sync_summary(fast), "engine_was_stale_before": stale}


def run_ipc(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """vLLM starts on a config-only copy (dummy weights) while the trainer's checkpoint is built on
    CPU (nothing may allocate GPU memory while vLLM profiles it); then the ranks load it."""
    from vime_trainer.megatron.actor_group import ActorGroup
    from vime_trainer.weight_sync.ipc import call_on_ranks

    cfg = trainer_config(work, args, gpu=True)
    engine, url = start_engine(
        cfg, bench_model(work / "engine-model", args.size, gpu=True, weights=False), "bench", work / "logs"
    )
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            building = pool.submit(bench_model, work / "trainer-model", args.size, gpu=True)
            wait_engine(engine, url)
            engine_start = time.monotonic() - t0
            trainer_model = building.result()
        console.print(f"vLLM up in {engine_start:.0f}s; checkpoint built in {time.monotonic() - t0:.0f}s")
        group = ActorGroup(cfg, str(trainer_model))
        try:
            t0 = time.monotonic()
            group.start()
            out: dict[str, Any] = {
                "engine_start_s": round(engine_start, 1),
                "trainer_start_s": round(time.monotonic() - t0, 1),
            }
            stock, rounds = ipc_rounds(args, group, url)
            out |= stock
            if args.train_steps or args.fast_rounds:  # the engine sleeps while the trainer trains
                httpx.post(url + "/sleep", params={"level": 2}, timeout=300).raise_for_status()
                out["train"] = train_steps(group, args, shape_named(args.size), on_gpu=True)
                call_on_ranks(group, _empty_cache)  # activations' blocks back before the KV cache wakes
            if args.fast_rounds:
                out["fast"] = fast_rounds(args, rounds)
            out["problems"] = rounds.problems
            return out
        finally:
            group.shutdown()
    finally:
        engine.stop(grace_s=30)


def _empty_cache(rank: Any) -> None:
    import torch

    torch.cuda.empty_cache()


def main() -> int:
    args = parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="vime-bench-sync-"))
    work.mkdir(parents=True, exist_ok=True)
    shape = shape_named(args.size)
    console.print(f"{args.transport}: model {args.size}, work dir {work}")
    result = run_ipc(args, work) if args.transport == "ipc" else run_shm(args, work)
    emit("weight_sync", transport=args.transport, size=args.size, shape=shape.__dict__, **result)
    for problem in result.get("problems", []):
        console.print(f"[red]✗ {problem}[/]")
    return 1 if result.get("problems") else 0


if __name__ == "__main__":
    sys.exit(main())
