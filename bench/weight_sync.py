"""The trainer's weight push (seed steps 45–52) on CPU with the ``shm`` transport, against the floor
of moving the same bytes through the same shared memory, measured in the same run.

Push: the real path of a run — `ActorGroup` (Megatron ranks as Ray actors, TP×PP gather, HF
names, buckets written by rank 0 as safetensors in ``--dir``) → `WeightSync` (pause, start, one
``/update_weights`` per bucket to every engine concurrently, finish with the version, resume) →
CPU reference engines that load each file into their model.

Baseline: the same HF tensors, bucketed the same way, written to the same directory and read
back in this process (``weights.shm.write_bucket`` + ``read_bucket``): the bytes' round trip
through tmpfs with no trainer ranks, no HTTP and no engine.

Printed per round: push seconds, baseline seconds, GB/s of both, and the ratio push / baseline
(lower is better; the gap is the ranks' gather, the protocol's round trips and the engines'
copy into their parameters). The GPU variant (``ipc`` transport into vLLM engines) is to come: it
needs the GPU host.

    python bench/weight_sync.py [--size micro|small] [--engines 2] [--rounds 5] [--tp 1] [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vime import procs
from vime.config import load_config
from vime.models.tiny import ensure_tiny_qwen3
from vime.wire.rollout import EngineInfo

console = Console()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=("nano", "micro", "small"))
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--dir", type=Path, default=None, help="bucket directory (default: /dev/shm)")
    return p.parse_args()


def start_engines(model: Path, n: int, logs: Path) -> tuple[list[procs.Child], list[str]]:
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


def baseline(group: object, directory: str | None) -> tuple[float, int]:
    """Write + read the same buckets in this process: the tmpfs floor."""
    from vime_trainer.weights.buckets import pack_buckets
    from vime_trainer.weights.shm import read_bucket, write_bucket

    state = group.call("hf_state_dict")[0]  # type: ignore[attr-defined]
    import torch

    tensors = [(n, torch.tensor(a)) for n, a in state.items()]
    size = group.config.trainer.packed_buffer_size_bytes  # type: ignore[attr-defined]
    t0, nbytes = time.perf_counter(), 0
    for bucket in pack_buckets(tensors, size):
        path = write_bucket(bucket, directory, prefix="bench-baseline")
        nbytes += sum(t.numel() * t.element_size() for t in read_bucket(path).values())
        path.unlink()
    return time.perf_counter() - t0, nbytes


async def push(sync: object, engines: list[EngineInfo], version: int) -> tuple[float, int, int]:
    report = await sync.push(engines, version, flush=True)  # type: ignore[attr-defined]
    return report.seconds, report.nbytes, report.buckets


def main() -> None:
    args = parse_args()
    from vime_trainer.megatron.actor_group import ActorGroup
    from vime_trainer.weight_sync import WeightSync
    from vime_trainer.weight_sync.shm import ShmTransport

    work = Path(tempfile.mkdtemp(prefix="vime-bench-sync-"))
    model = ensure_tiny_qwen3(work / "models", args.size)
    cfg = load_config(
        overrides=[
            "rollout_num_gpus=0",
            "actor_num_gpus_per_node=0",
            f"actor_num_cpu_ranks={args.tp}",
            f"tensor_model_parallel_size={args.tp}",
            "rollout_batch_size=1",
            "n_samples_per_prompt=4",
            "micro_batch_size=4",
            f"trainer.packed_buffer_size_bytes={args.bucket_mb << 20}",
            f"trainer.checkpoint_dir={work / 'ckpt'}",
        ],
        environ={},
    )
    directory = str(args.dir) if args.dir else None
    console.print(f"model {args.size} at {model}; {args.engines} reference engine(s); TP={args.tp}")
    children, urls = start_engines(model, args.engines, work / "logs")
    group = ActorGroup(cfg, str(model))
    try:
        group.start()
        sync = WeightSync(ShmTransport(group, directory))
        infos = [
            EngineInfo(index=i, url=u, backend="reference", status="ready", registered=True)
            for i, u in enumerate(urls)
        ]
        table = Table(
            "round", "buckets", "MB", "push s", "push GB/s", "baseline s", "baseline GB/s", "push / baseline"
        )
        ratios = []
        for r in range(args.rounds):
            push_s, nbytes, buckets = asyncio.run(push(sync, infos, r + 1))
            base_s, base_bytes = baseline(group, directory)
            ratios.append(push_s / base_s)
            table.add_row(
                str(r),
                str(buckets),
                f"{nbytes / 1e6:.1f}",
                f"{push_s:.3f}",
                f"{nbytes / push_s / 1e9:.2f}",
                f"{base_s:.3f}",
                f"{base_bytes / base_s / 1e9:.2f}",
                f"{ratios[-1]:.2f}",
            )
        console.print(table)
        console.print(f"median push / baseline: {statistics.median(ratios):.2f} over {args.rounds} rounds")
    finally:
        group.shutdown()
        for child in children:
            child.stop()


if __name__ == "__main__":
    main()
