"""The trainer's weight push (seed steps 45–52), against the floor of moving the same bytes, measured
in the same run. Two transports:

``--transport shm`` (CPU, default): `ActorGroup` (Megatron ranks as Ray actors; rank 0 writes the HF
buckets as safetensors in ``--dir``) → `WeightSync` (pause, start, one ``/update_weights`` per
bucket to every engine concurrently, finish with the version, resume) → CPU reference engines.
Baseline: the same buckets written to the same directory and read back in this process.

``--transport ipc`` (GPU host, one GPU, vLLM installed): the colocated flow of a step with a real
``vllm serve`` started with dummy weights: engine ``/sleep?level=2`` → trainer sleeps → engine
``/wake_up?tags=weights`` → IPC push (the ranks gather from their CPU backup onto the GPU and
share each bucket by CUDA IPC handle) → ``/wake_up?tags=kv_cache``. Checked first: the engine's
greedy next token equals the trainer's for every probe prompt after the push (and not before:
dummy weights). Baseline: host→device copy of the same bytes on the rank.

Printed per round: push seconds, baseline seconds, GB/s of both, and push / baseline (lower is
better; the gap is the ranks' gather and conversion, the protocol's round trips and the engines'
loading).

    python bench/weight_sync.py [--transport shm|ipc] [--size micro|small] [--engines 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from vime import procs
from vime.config import load_config
from vime.models.tiny import ensure_tiny_qwen3
from vime.wire.rollout import EngineInfo

console = Console()
VLLM_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="shm", choices=("shm", "ipc"))
    p.add_argument("--size", default="small", choices=("nano", "micro", "small"))
    p.add_argument("--engines", type=int, default=2, help="shm: reference engines")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tp", type=int, default=1, help="shm: CPU trainer ranks (TP size)")
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--unpacked", action="store_true", help="ipc: one handle per tensor")
    p.add_argument("--dir", type=Path, default=None, help="shm: bucket directory (default: /dev/shm)")
    return p.parse_args()


def trainer_config(work: Path, args: argparse.Namespace, gpu: bool) -> Any:
    ranks = (
        ["actor_num_gpus_per_node=1", "rollout_num_gpus=1", "rollout_num_gpus_per_engine=1"]
        if gpu
        else ["actor_num_gpus_per_node=0", "rollout_num_gpus=0", f"actor_num_cpu_ranks={args.tp}"]
    )
    return load_config(
        overrides=[
            *ranks,
            f"tensor_model_parallel_size={1 if gpu else args.tp}",
            "rollout_batch_size=1",
            "n_samples_per_prompt=4",
            "micro_batch_size=4",
            f"trainer.packed_buffer_size_bytes={args.bucket_mb << 20}",
            f"trainer.ipc_packed={not args.unpacked}",
            f"trainer.checkpoint_dir={work / 'ckpt'}",
        ],
        environ={},
    )


def report(rounds: list[tuple[int, int, float, float]]) -> None:
    table = Table(
        "round", "buckets", "MB", "push s", "push GB/s", "baseline s", "baseline GB/s", "push / baseline"
    )
    for r, (buckets, nbytes, push_s, base_s) in enumerate(rounds):
        table.add_row(
            str(r),
            str(buckets),
            f"{nbytes / 1e6:.1f}",
            f"{push_s:.3f}",
            f"{nbytes / push_s / 1e9:.2f}",
            f"{base_s:.3f}",
            f"{nbytes / base_s / 1e9:.2f}",
            f"{push_s / base_s:.2f}",
        )
    console.print(table)
    ratio = statistics.median(p / b for _, _, p, b in rounds)
    console.print(f"median push / baseline: {ratio:.2f} over {len(rounds)} rounds")


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
    from vime_trainer.weights.buckets import pack_buckets
    from vime_trainer.weights.shm import read_bucket, write_bucket

    tensors = [(n, torch.tensor(a)) for n, a in group.call("hf_state_dict")[0].items()]
    t0 = time.perf_counter()
    for bucket in pack_buckets(tensors, group.config.trainer.packed_buffer_size_bytes):
        path = write_bucket(bucket, directory, prefix="bench-baseline")
        read_bucket(path)
        path.unlink()
    return time.perf_counter() - t0


def run_shm(args: argparse.Namespace, work: Path, model: Path) -> list[tuple[int, int, float, float]]:
    from vime_trainer.megatron.actor_group import ActorGroup
    from vime_trainer.weight_sync import WeightSync
    from vime_trainer.weight_sync.shm import ShmTransport

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
            rounds.append((rep.buckets, rep.nbytes, rep.seconds, tmpfs_round_trip(group, directory)))
        return rounds
    finally:
        group.shutdown()
        for child in children:
            child.stop()


# --- ipc (GPU) ------------------------------------------------------------------------------------


def start_vllm(model: Path, logs: Path) -> tuple[procs.Child, str]:
    port = procs.free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--port", str(port),
        "--load-format", "dummy", "--enable-sleep-mode", "--enforce-eager", "--dtype", "bfloat16",
        "--weight-transfer-config", json.dumps({"backend": "ipc"}), "--gpu-memory-utilization", "0.3",
        "--max-model-len", "512",
    ]  # fmt: skip
    child = procs.start("vllm", argv, log_path=logs / "vllm.log", env=VLLM_ENV)
    url = f"http://127.0.0.1:{port}"
    procs.wait_healthy(url, child, timeout_s=600)
    return child, url


PROMPTS = [[(7 * i + 13 * j) % 120 + 3 for j in range(8)] for i in range(8)]


def greedy_agrees(group: Any, url: str) -> bool:
    """The engine's greedy next token is the trainer's argmax (or within bf16 noise of it) for every prompt."""
    import numpy as np

    logits = next(x for x in group.call("logits", np.array(PROMPTS)) if x is not None)[:, -1, :]
    for prompt, row in zip(PROMPTS, logits, strict=True):
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1, "temperature": 0.0}}
        token = httpx.post(url + "/inference/v1/generate", json=body, timeout=60).json()["choices"][0][
            "token_ids"
        ][0]
        if row[token] < row.max() - 0.05:
            return False
    return True


def host_to_device_seconds(rank: Any) -> float:
    """Runs in the rank: copy its CPU weight backup to the GPU (what the push reads while it sleeps)."""
    import torch

    backup = rank.backup.get("actor")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    copies = [t.to("cuda", non_blocking=True) for t in backup.values()]
    torch.cuda.synchronize()
    del copies
    return time.perf_counter() - t0


async def colocated_push(sync: Any, group: Any, url: str, info: EngineInfo, version: int) -> Any:
    """Seed 33–36, 41, 43, 45–52, 54 on one GPU: engine sleeps, trainer sleeps, weights wake, push, KV wakes."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        (await http.post("/sleep", params={"level": 2, "mode": "keep"})).raise_for_status()
        await asyncio.to_thread(group.sleep)
        (await http.post("/wake_up", params={"tags": "weights"})).raise_for_status()
        rep = await sync.push([info], version, flush=True)
        (await http.post("/wake_up", params={"tags": "kv_cache"})).raise_for_status()
    return rep


def run_ipc(args: argparse.Namespace, work: Path, model: Path) -> list[tuple[int, int, float, float]]:
    from vime_trainer.megatron.actor_group import ActorGroup
    from vime_trainer.weight_sync import WeightSync
    from vime_trainer.weight_sync.ipc import IpcTransport, call_on_ranks

    engine, url = start_vllm(model, work / "logs")
    group = ActorGroup(trainer_config(work, args, gpu=True), str(model))
    try:
        group.start()
        assert not greedy_agrees(group, url), (
            "the engine agrees with the trainer before any push (not dummy weights?)"
        )
        sync = WeightSync(IpcTransport(group, packed=not args.unpacked))
        info = EngineInfo(index=0, url=url, backend="vllm", status="ready", registered=True)
        rounds = []
        for r in range(args.rounds):
            rep = asyncio.run(colocated_push(sync, group, url, info, r + 1))
            if not greedy_agrees(group, url):  # wakes the trainer again
                raise SystemExit(f"round {r}: after the IPC push the engine disagrees with the trainer")
            base = call_on_ranks(group, host_to_device_seconds)[0]
            rounds.append((rep.buckets, rep.nbytes, rep.seconds, base))
        console.print("[green]the engine generates the trainer's greedy tokens after every push[/]")
        return rounds
    finally:
        group.shutdown()
        engine.stop()


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="vime-bench-sync-"))
    model = ensure_tiny_qwen3(work / "models", args.size)
    console.print(f"{args.transport}: model {args.size} at {model}")
    report(run_ipc(args, work, model) if args.transport == "ipc" else run_shm(args, work, model))


if __name__ == "__main__":
    main()
