"""The trainer's weight push (seed steps 45–52) as ``vime train`` runs it, both ``engine.weight_load``
values in the same run, against the floor of moving the same bytes.

Each push goes through `make_weight_sync` — the code path a run takes — with the config's
``engine.weight_load`` set to ``vllm`` (vLLM's ``/update_weights``) or ``direct`` (the worker
extension copying each bucket into precomputed parameter views). The engines are started with the
extension (what ``engine.weight_load: direct`` does); the ``vllm`` rounds do not use it. Rounds of
the two kinds alternate, so both see the same machine state.

Every round is the colocated flow of a step: the trainer's weights change (its final norm is
negated, so the engines' greedy tokens must change too) → the engines must now disagree with the
trainer → engines ``/sleep?level=2`` → (``--asleep-rounds``: the trainer sleeps, step 41, keeping
its weights on the GPU as ``vime train`` does) → ``/wake_up?tags=weights`` → the push → (the
trainer's weights go) → ``/wake_up?tags=kv_cache`` → every
engine's greedy next token must be the trainer's for every probe prompt. A round that fails is
reported with its error and the others go on; the figures are always written.

``--transport ipc`` (GPU host, one GPU, vLLM installed): one ``vllm serve`` started by the rollout
manager's command builder with dummy weights, the trainer's rank on the same GPU. Baselines:
a device-to-device copy of the same bytes on the rank (both kinds of round read the trainer's
parameters on the GPU).
``--transport shm`` (CPU): reference engines, CPU ranks; baseline: writing and reading the same
buckets in tmpfs.

Per round: pause→resume seconds and each phase (pause, flush, start/update/finish or update/label,
resume; with ``direct`` also the staging buffers' open before the pause and close after the
resume), GB/s, the baseline, push / baseline. Goal for a Qwen3-4B shape (8.8 GB) with ``direct``:
≤ 0.1 s. ``--train-steps N`` then trains N GRPO steps on the same ranks (engines asleep; no push
after) and prints the step time and MFU. A final ``VIME_RESULT {...}`` line has everything; the exit
status is 1 when any check or round failed.

``--lean``: the trainer's state and the engines are never awake together, as in ``vime train``
(the Qwen3-4B shape's trainer holds ~72 GiB awake, so this is how it fits beside an engine on an
80 GB H100). The engines sleep (level 1, their weights kept) before the trainer starts; every round
is a trainer-asleep push, and both greedy checks compare the engines with the logits the trainer
computed before it slept; the D2D baseline is measured with the trainer asleep.

    python bench/weight_sync.py --transport ipc --size qwen3-4b --rounds 3 --asleep-rounds 2 --train-steps 3
    python bench/weight_sync.py --transport ipc --size qwen3-4b --lean --rounds 0 --asleep-rounds 3
    python bench/weight_sync.py [--transport shm] [--size micro|small] [--engines 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpu_common import (
    bench_model,
    console,
    emit,
    start_engine,
    sync_summary,
    sync_table,
    train_steps,
    wait_engine,
)
from weight_sync_rounds import KINDS, Rounds, empty_cache, on_engines, parse_spec

from vime import procs
from vime.config import RunConfig, load_config
from vime.models.tiny import QWEN3_SHAPES, SHAPES, build_tiny_qwen3, shape_named
from vime.wire.direct_load import EXTENSION
from vime.wire.rollout import EngineInfo


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="shm", choices=("shm", "ipc"))
    p.add_argument("--size", default="small", choices=[*SHAPES, *QWEN3_SHAPES])
    p.add_argument("--engines", type=int, default=2, help="shm: reference engines")
    p.add_argument(
        "--weight-loads",
        nargs="+",
        default=list(KINDS),
        help="engine.weight_load values, each KIND or KIND@MB (its own trainer.packed_buffer_size_bytes)",
    )
    p.add_argument("--rounds", type=int, default=3, help="pushes of each kind from the awake trainer")
    p.add_argument(
        "--asleep-rounds",
        type=int,
        default=0,
        help="ipc: pushes of each kind with the trainer asleep (step 41)",
    )
    p.add_argument(
        "--lean",
        action="store_true",
        help="the trainer's state and the engines never awake together (trainer-asleep rounds only)",
    )
    p.add_argument("--set", action="append", default=[], help="a config override KEY=VALUE (repeatable)")
    p.add_argument("--train-steps", type=int, default=0, help="then train this many steps (MFU)")
    p.add_argument("--train-samples", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--response-len", type=int, default=824)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H200: 989)")
    p.add_argument("--tp", type=int, default=1, help="shm: CPU trainer ranks (TP size)")
    p.add_argument("--bucket-mb", type=int, default=None, help="default: 1024 (ipc, the trainer's), 64 (shm)")
    p.add_argument("--unpacked", action="store_true", help="ipc, vllm: one handle per tensor")
    p.add_argument("--dir", type=Path, default=None, help="shm: bucket directory (default: /dev/shm)")
    p.add_argument("--work", type=Path, default=None, help="scratch and logs (default: a temp dir)")
    args = p.parse_args()
    if args.bucket_mb is None:
        args.bucket_mb = 1024 if args.transport == "ipc" else 64
    for spec in args.weight_loads:
        try:
            parse_spec(spec)
        except ValueError as exc:
            p.error(f"--weight-loads {spec}: {exc}")
    if args.lean and (args.rounds or not args.asleep_rounds):
        p.error("--lean pushes from the sleeping trainer only: --rounds 0 --asleep-rounds N")
    return args


def trainer_config(work: Path, args: argparse.Namespace, gpu: bool) -> RunConfig:
    """The run's config; ``engine.weight_load=direct`` so the engines start with the extension."""
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
    samples = args.train_samples if args.train_steps else 4
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
            "engine.extra_args=[--load-format, dummy, --dtype, bfloat16]",
            "engine.weight_load=direct",
            f"engine.base_port={procs.free_port()}",
            f"trainer.packed_buffer_size_bytes={args.bucket_mb << 20}",
            f"trainer.ipc_packed={not args.unpacked}",
            f"trainer.checkpoint_dir={work / 'ckpt'}",
            *([f"trainer.weight_dir={args.dir}"] if args.dir else []),
            *args.set,
        ],
        environ={},
    )


def measure(args: argparse.Namespace, rounds: Rounds, out: dict[str, Any]) -> None:
    """The rounds of each kind, alternating; then the training steps (no push after them)."""
    from vime_trainer.weight_sync.ipc import call_on_ranks

    if rounds.gpu and not rounds.lean and rounds.agree():
        rounds.problems.append("the engines agree with the trainer before any push (not dummy weights?)")
    kinds = args.weight_loads
    groups = [("from_gpu" if rounds.gpu else "from_trainer", False, args.rounds)] if args.rounds else []
    if (rounds.gpu or rounds.lean) and args.asleep_rounds:
        groups.append(("trainer_asleep", True, args.asleep_rounds))
    for label, sleeps, count in groups:
        done: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for _ in range(count):
            for kind in kinds:
                done[kind].append(rounds.run(kind, sleeps, label))
        for kind in kinds:
            sync_table(f"{kind}: push {label.replace('_', ' ')} vs baseline", done[kind])
            out.setdefault(kind, {})[label] = sync_summary(done[kind])
        medians = {k: out[k][label].get("median_sync_s") for k in kinds}
        for spec in kinds:
            if spec != "vllm" and medians.get("vllm") and medians.get(spec):
                ratio = round(medians[spec] / medians["vllm"], 3)
                out.setdefault(f"{spec}_over_vllm", {})[label] = ratio
    for step in ("open", "close"):  # each push's, outside pause → resume: the ranks' part, the engines'
        out[f"direct_{step}_s"] = [
            {k: d.get(k) for k in ("seconds", "ranks_s", "engines_s")}
            for a, d in rounds.events
            if a == f"weights.direct_{step}"
        ]
    out["direct_refused"] = [d.get("reason") for a, d in rounds.events if a == "weights.direct_refused"]
    if args.train_steps:  # the engines sleep while the trainer trains
        on_engines(rounds.engines, "/sleep", level=2)
        if rounds.lean:  # its rounds leave the trainer asleep
            rounds.group.wake_up()
        try:
            out["train"] = train_steps(rounds.group, args, shape_named(args.size), on_gpu=rounds.gpu)
        except Exception as exc:
            rounds.problems.append(f"training failed: {type(exc).__name__}: {exc}")
        if rounds.gpu:
            call_on_ranks(rounds.group, empty_cache)


def start_reference_engines(model: Path, n: int, logs: Path) -> tuple[list[procs.Child], list[str]]:
    children, urls = [], []
    for k in range(n):
        port = procs.free_port()
        argv = procs.python_module(
            "vime_rollout.reference_engine",
            *(
                "--model",
                str(model),
                "--port",
                str(port),
                "--threads",
                "1",
                "--worker-extension-cls",
                EXTENSION,
            ),
        )
        children.append(procs.start(f"engine{k}", argv, log_path=logs / f"engine{k}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    for child, url in zip(children, urls, strict=True):
        procs.wait_healthy(url, child, timeout_s=180)
    return children, urls


def run(args: argparse.Namespace, work: Path, out: dict[str, Any]) -> list[str]:
    """Engines and trainer up, then `measure`; returns the problems. vLLM starts on a config-only
    copy (dummy weights) while the trainer's checkpoint is built on CPU (nothing may allocate GPU
    memory while vLLM profiles it)."""
    from vime_trainer.megatron.actor_group import ActorGroup

    gpu = args.transport == "ipc"
    cfg = trainer_config(work, args, gpu=gpu)
    children: list[procs.Child] = []
    t0 = time.monotonic()
    try:
        if gpu:
            engine, url = start_engine(
                cfg,
                bench_model(work / "engine-model", args.size, gpu=True, weights=False),
                "bench",
                work / "logs",
            )
            children.append(engine)
            with ThreadPoolExecutor(1) as pool:
                building = pool.submit(bench_model, work / "trainer-model", args.size, gpu=True)
                wait_engine(engine, url)
                out["engine_start_s"] = round(time.monotonic() - t0, 1)
                model = building.result()
            urls = [url]
        else:
            model = build_tiny_qwen3(work / "model", args.size)
            children, urls = start_reference_engines(model, args.engines, work / "logs")
        engines = [
            EngineInfo(
                index=i,
                url=u,
                backend="vllm" if gpu else "reference",
                status="ready",
                registered=True,
                gpu_ids=[0] if gpu else [],
            )
            for i, u in enumerate(urls)
        ]
        if args.lean:  # the trainer starts beside sleeping engines
            on_engines(engines, "/sleep", level=1)
        group = ActorGroup(cfg, str(model))
        try:
            t0 = time.monotonic()
            group.start()
            out["trainer_start_s"] = round(time.monotonic() - t0, 1)
            rounds = Rounds(cfg, group, engines, gpu, args.weight_loads, lean=args.lean)
            try:
                measure(args, rounds, out)
            finally:
                rounds.close()
            return rounds.problems
        finally:
            group.shutdown()
    finally:
        for child in children:
            child.stop(grace_s=30)


def main() -> int:
    args = parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="vime-bench-sync-"))
    work.mkdir(parents=True, exist_ok=True)
    shape = shape_named(args.size)
    console.print(f"{args.transport}: model {args.size}, weight loads {args.weight_loads}, work dir {work}")
    out: dict[str, Any] = {}
    problems: list[str] = []
    try:
        problems = run(args, work, out)
    except Exception as exc:  # start-up failed: still say so in the results
        problems = [f"{type(exc).__name__}: {exc}"]
        raise
    finally:
        goal: dict[str, Any] = {"goal_s": 0.1}  # pause → resume, per direct spec and kind of round
        for spec, rounds in out.items():
            if spec.startswith("direct") and isinstance(rounds, dict):
                for label in ("from_gpu", "trainer_asleep"):
                    if isinstance(rounds.get(label), dict):
                        goal[f"{spec}_{label}_s"] = rounds[label].get("median_sync_s")
        emit(
            "weight_sync",
            transport=args.transport,
            size=args.size,
            shape=shape.__dict__,
            goal=goal,
            problems=problems,
            **out,
        )
        for problem in problems:
            console.print(f"[red]✗ {problem}[/]")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
