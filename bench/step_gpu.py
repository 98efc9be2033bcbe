"""The full colocated RL step on the GPU machine: ``T_step`` and each of its parts, the transitions'
share of it, and the weight push's GB/s — the seed's scenario scaled to one GPU.

The stack is what ``vime up`` starts (Redis, router, reward, rollout manager with one real vLLM
engine, trainer service with Megatron ranks), on one GPU, colocated: vLLM sleeps while Megatron
trains, weights go over CUDA IPC. A run of ``--rollouts`` steps (default 3) of ``--prompts`` × ``--n``
samples (32 × 8) with responses up to ``--response-len`` (1024) tokens on a random model of a Qwen3
shape (default 0.6B) is started over REST and followed to its end; the per-step record
(``runs/<id>/metrics.jsonl``) and event log give

    T_step = T_rollout + T_offload + T_train + T_onload_weights + T_weight_sync + T_onload_kv

per step, the transitions (offload + onload weights + weight sync + onload KV) as % of T_step
(goal < 3 %), and the push: bytes, pause→resume seconds and each of its phases (the step's
``weights/<phase>_s`` metrics), GB/s. Step 0 pays warm-ups (first optimizer step, allocator
growth); the summary is the median of the later steps.

``--runs direct vllm`` runs one run per entry, one after the other on the same stack (engines
started with the direct-load extension when an entry asks for it), and compares their steady
medians. An entry is an ``engine.weight_load`` value, optionally followed by run overrides the
trainer takes per run (``direct,offload_train=false``: the trainer's state stays on the GPU while
the engines run), so two settings are compared on one machine and one vLLM start.

``--compare-rollout`` first measures, on the same engines before the run starts, the same
requests sent straight to the engine vs through the manager + router (an eval rollout over the
training prompts at temperature 1; nothing is published): output tokens/s and their ratio
(goal ≥ 0.97). ``bench/rollout_gpu.py`` does this alone, with and without log-probs.

    python bench/step_gpu.py --engine vllm --size qwen3-0.6b --prompts 32 --n 8 --response-len 1024 --rollouts 3 \
        --runs direct vllm
    python bench/step_gpu.py --engine reference --size micro --prompts 4 --n 4 --response-len 16 --rollouts 2  # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_common import bench_model, console, direct_round, emit, manager_payloads, write_prompts
from rich.table import Table

from vime import procs
from vime.clients.rollout import RolloutClient
from vime.clients.trainer import TrainerClient
from vime.config import ConfigError, RunConfig, load_config, parse_overrides
from vime.launch.signals import SignalLatch
from vime.launch.stack import plan_stack
from vime.launch.supervisor import Supervisor
from vime.models.tiny import QWEN3_SHAPES, SHAPES
from vime.wire.trainer import STEP_PHASES

TOKEN = "bench-step-token"
RUN_ID = "bench-step"
PROMPT_LEN = 200
TRANSITIONS = ("offload", "onload_weights", "weight_sync", "onload_kv")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["vllm", "reference"], default="vllm")
    p.add_argument("--size", default="qwen3-0.6b", choices=[*SHAPES, *QWEN3_SHAPES])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--rollouts", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs (faster start)")
    p.add_argument("--logprobs", action="store_true", help="request rollout log-probs (mismatch metrics on)")
    p.add_argument("--compare-rollout", action="store_true")
    p.add_argument(
        "--runs",
        nargs="+",
        type=RunSpec.parse,
        default=[RunSpec.parse("vllm")],
        help="one run each, in order, same stack: WEIGHT_LOAD[,KEY=VALUE...] (e.g. direct,offload_train=false)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for the whole stack, e.g. trainer.packed_sequences=true",
    )
    p.add_argument("--work", type=Path, default=None)
    return p.parse_args()


def run_config(work: Path, args: argparse.Namespace, model: Path) -> dict[str, Any]:
    gpu = args.engine == "vllm"
    layout: dict[str, Any] = (
        {"rollout_num_gpus": 1, "actor_num_gpus_per_node": 1}
        if gpu
        else {
            "rollout_num_gpus": 0,
            "rollout_num_engines_cpu": 1,
            "actor_num_gpus_per_node": 0,
            "actor_num_cpu_ranks": 1,
        }
    )
    engine: dict[str, Any] = {
        "backend": args.engine,
        "base_port": procs.free_port(),
        "startup_timeout_s": 600,
        "weight_load": "direct"
        if any(r.weight_load == "direct" for r in args.runs)
        else "vllm",  # the extension
    }
    if gpu:
        engine |= {"gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.enforce_eager}
    prompts = write_prompts(work / "prompts.jsonl", args.prompts, PROMPT_LEN)
    ports = {
        f"{n}_port": procs.free_port() for n in ("router", "router_control", "reward", "rollout", "trainer")
    }
    return {
        **layout,
        "run_id": RUN_ID,
        "output_dir": str(work / "runs"),
        "num_rollout": args.rollouts,
        "rollout_batch_size": args.prompts,
        "n_samples_per_prompt": args.n,
        "num_steps_per_rollout": 1,
        "micro_batch_size": args.micro_batch,
        "rollout_num_gpus_per_engine": 1,
        "tensor_model_parallel_size": 1,
        "rollout_max_prompt_len": PROMPT_LEN + 56,
        "rollout_max_response_len": args.response_len,
        "rollout_max_context_len": PROMPT_LEN + 56 + args.response_len,
        "vllm_server_concurrency": 512,
        "colocate": True,
        "get_mismatch_metrics": args.logprobs,
        "model": {"hf_checkpoint": str(model), "served_model_name": "bench"},
        "data": {
            "prompt_data": str(prompts),
            "eval_prompt_data": {"same": str(prompts)},
            "n_samples_per_eval_prompt": args.n,
            "eval_temperature": 1.0,
            "rollout_shuffle": False,
        },
        "reward": {"rm_type": "exact_match", "num_workers": 2},
        "engine": engine,
        "trainer": {"lr": 1e-6, "checkpoint_dir": str(work / "ckpt")},
        "services": {"host": "127.0.0.1", **ports, "api_token": TOKEN},
    }


async def compare_rollout(cfg: RunConfig, model: Path) -> dict[str, Any]:
    """Before the run: wake the engines, send the eval rollout's requests direct, then through the
    manager, and put the engines back to sleep as the run expects them."""
    async with RolloutClient(cfg.services.url("rollout"), token=TOKEN, timeout=1800) as client:
        await client.onload(None)
        urls = [e.url for e in (await client.engines()).engines]
        payloads = manager_payloads(cfg, model, logprobs=None, evaluation=True)
        await direct_round(urls, payloads[:16], cfg.rollout_concurrency)  # warm-up
        d_tokens, d_wall = await direct_round(urls, payloads, cfg.rollout_concurrency)
        t0 = time.perf_counter()
        job = await client.rollout(0, evaluation=True)
        e2e = time.perf_counter() - t0
        await client.offload()
    m = job.metrics
    m_tokens = m["eval/same/num_samples"] * m["eval/same/response_len_mean"]
    out = {
        "direct_tps": round(d_tokens / d_wall),
        "manager_tps": round(m_tokens / m["eval/same/wall_s"]),
        "manager_e2e_tps": round(m_tokens / e2e),
        "direct_tokens": d_tokens,
        "manager_tokens": round(m_tokens),
    }
    out["ratio"] = round(out["manager_tps"] / out["direct_tps"], 4)
    out["ratio_e2e"] = round(out["manager_e2e_tps"] / out["direct_tps"], 4)
    console.print(f"rollout direct vs manager (no log-probs): {out}")
    return out


@dataclass(frozen=True)
class RunSpec:
    """One run of the bench: how its pushes load weights, and other per-run overrides (``KEY=VALUE``,
    as ``--set`` takes them)."""

    weight_load: str
    overrides: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The run's name in the results and its run id: ``direct``, ``direct-offload_train-false``."""
        extra = "-".join(p.replace(".", "_").replace("=", "-") for p in self.overrides)
        return f"{self.weight_load}-{extra}".lower() if extra else self.weight_load

    @classmethod
    def parse(cls, text: str) -> RunSpec:
        weight_load, *pairs = text.split(",")
        if weight_load not in ("vllm", "direct"):
            raise argparse.ArgumentTypeError(f"{text!r}: starts with vllm or direct")
        spec = cls(weight_load, tuple(pairs))
        try:
            spec.request(0, 1)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
        return spec

    def request(self, first: int, rollouts: int) -> dict[str, Any]:
        """The run request's config: these settings, from rollout id ``first`` (a later run continues
        the ids, so the rollout manager publishes new batches for it)."""
        config = parse_overrides([f"engine.weight_load={self.weight_load}", *self.overrides])
        return config | {"start_rollout_id": first, "num_rollout": first + rollouts}


async def run(
    cfg: RunConfig, run_id: str, spec: RunSpec, first: int, timeout_s: float
) -> tuple[Any, list[dict[str, Any]]]:
    """One run of ``cfg.num_rollout`` rollouts from rollout id ``first``."""
    override = spec.request(first, cfg.num_rollout)
    async with TrainerClient(cfg.services.url("trainer"), token=TOKEN, timeout=60) as client:
        await client.start_run(override, run_id=run_id)
        status = await client.wait_run(run_id, timeout_s=timeout_s, poll_s=1.0)
        events = [e.model_dump() for e in (await client.events(run_id)).events]
    return status, events


def push_figures(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per rollout: bytes pushed, pause → resume seconds and GB/s, how it was loaded, each phase."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        rid, detail = e["rollout_id"], e["detail"]
        if e["action"] == "weights.loaded" and rid is not None:
            seconds = float(detail.get("seconds") or 0.0)
            out[rid] = {
                "bytes": float(detail.get("nbytes", 0)),
                "pause_to_resume_s": seconds,
                "GBps": float(detail.get("nbytes", 0)) / seconds / 1e9 if seconds else float("nan"),
                "weight_load": detail.get("weight_load"),
                "phases": detail.get("phases", {}),
                "update_parts": detail.get("update_parts", {}),
            }
    return out


def save_figures(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per checkpoint: the seconds it held the loop (``trainer.save``) and after how many seconds
    it counted (``trainer.saved``: its files written, in the background for a ``save_interval`` one)."""
    held = {e["detail"]["path"]: e["detail"].get("seconds") for e in events if e["action"] == "trainer.save"}
    return [
        {
            "path": Path(e["detail"]["path"]).name,
            "held_s": held.get(e["detail"]["path"]),
            "complete_s": e["detail"].get("seconds"),
        }
        for e in events
        if e["action"] == "trainer.saved"
    ]


def report(rows: list[dict[str, Any]], pushes: dict[int, dict[str, Any]], weight_load: str) -> dict[str, Any]:
    table = Table(title=f"colocated step, engine.weight_load={weight_load}: T_step and its parts (s)")
    for col in (
        "rollout id",
        "T_step",
        *STEP_PHASES,
        "transitions %",
        "push GB",
        "pause→resume s",
        "push GB/s",
        "response len",
    ):
        table.add_column(col, justify="right")
    steps = []
    for r in rows:
        t = {p: r[f"perf/T_{p}"] for p in STEP_PHASES}
        transitions = sum(t[p] for p in TRANSITIONS)
        trans = transitions / r["perf/T_step"]
        push = pushes.get(r["rollout_id"], {})
        # the shortest response: one below the longest makes chunks of a new length (what
        # recompiled the log-prob pass once; rank_compiled_graphs shows whether it did)
        shortest, longest = r.get("rollout/response_len_min"), r.get("rollout/response_len_max")
        steps.append(
            {
                "rollout_id": r["rollout_id"],
                "T_step": r["perf/T_step"],
                **t,
                "transitions": transitions,
                "transitions_frac": trans,
                "save": r.get("perf/T_save", 0.0),  # not part of T_step: what a checkpoint held the loop
                "response_len_min": shortest,
                "response_len_max": longest,
                **push,
                **rank_parts(r),
            }
        )
        table.add_row(
            str(r["rollout_id"]),
            f"{r['perf/T_step']:.2f}",
            *(f"{t[p]:.3f}" for p in STEP_PHASES),
            f"{trans:.2%}",
            f"{push.get('bytes', 0) / 1e9:.2f}",
            f"{push.get('pause_to_resume_s', float('nan')):.3f}",
            f"{push.get('GBps', float('nan')):.1f}",
            "—" if shortest is None or longest is None else f"{shortest:.0f}–{longest:.0f}",
        )
    console.print(table)
    steady = steps[1:] or steps
    parts = sorted({k for s in steady for k in s if k.startswith(("rank_t_", "rank_compiled", "trainer_"))})
    keys = (
        "T_step",
        *STEP_PHASES,
        "transitions",
        "transitions_frac",
        "save",
        "pause_to_resume_s",
        "GBps",
        *parts,
    )
    median = {
        k: round(statistics.median(s[k] for s in steady if k in s), 4)
        for k in keys
        if any(k in s for s in steady)
    }
    console.print(
        f"median of steps {[s['rollout_id'] for s in steady]}: {median} (goal: transitions < 3% of T_step)"
    )
    return {"steps": steps, "steady_median": median, "goal_transitions_frac": 0.03}


def rank_parts(row: dict[str, Any]) -> dict[str, float]:
    """Where ``T_train`` went: the training rank's parts (``train/t_*_s``) as ``rank_t_*_s`` and the
    graphs it compiled (``rank_compiled_graphs``: a steady step should have none), and
    the trainer's wake-up and sleep (``trainer/*_s``) and its memory (``trainer/peak_gib``, the
    step's peak; ``trainer/asleep_reserved_gib``, what it holds while the engines run) as ``trainer_*``."""
    parts = {
        f"rank_{k.removeprefix('train/')}": float(v)
        for k, v in row.items()
        if k.startswith(("train/t_", "train/compiled_graphs"))
    }
    return parts | {k.replace("/", "_"): float(v) for k, v in row.items() if k.startswith("trainer/")}


COMPARED = (
    "T_step",
    "train",
    "rank_t_passes_s",
    "rank_compiled_graphs",
    "trainer_wake_s",
    "trainer_sleep_s",
    "trainer_freed_gib",
    "trainer_peak_gib",
    "trainer_peak_reserved_gib",
    "trainer_alloc_retries",
    "trainer_asleep_reserved_gib",
    "weight_sync",
    "pause_to_resume_s",
    "onload_kv",
    "transitions",
    "transitions_frac",
)
"""The steady medians set side by side when a bench has several runs."""


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each compared part's steady median per run (None where a run has none), as a table."""
    medians = {label: r.get("steady_median", {}) for label, r in runs.items()}
    out = {key: {label: m.get(key) for label, m in medians.items()} for key in COMPARED}
    table = Table(title="steady medians side by side (same stack, same engines)")
    table.add_column("part")
    for label in medians:
        table.add_column(label, justify="right")
    for key, row in out.items():
        table.add_row(key, *("—" if v is None else f"{v:.4g}" for v in row.values()))
    console.print(table)
    return out


def gpu_probe(when: str) -> dict[str, Any]:
    """`gpu_probe.py` in a fresh process (GEMM, copy, launch cost): is the GPU itself slower now?"""
    script = Path(__file__).with_name("gpu_probe.py")
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except Exception as exc:  # a probe that fails is reported, the runs go on
        result = {"error": f"{type(exc).__name__}: {exc}"}
    console.print(f"gpu probe, {when}: {result}")
    return {"when": when, **result}


def main() -> None:
    args = parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="vime-bench-step-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = bench_model(work / "model", args.size, gpu=args.engine == "vllm")
    console.print(f"model {args.size} built in {time.monotonic() - t0:.0f}s")
    plan = plan_stack(load_config(base=run_config(work, args, model), overrides=args.overrides, environ={}))
    sup = Supervisor(plan, console, SignalLatch())
    out: dict[str, Any] = {
        "engine": args.engine,
        "size": args.size,
        "samples": args.prompts * args.n,
        "response_len": args.response_len,
        "runs": {},
    }
    runs: dict[str, tuple[str, list[dict[str, Any]]]] = {}
    try:
        t0 = time.monotonic()
        sup.start()
        out["stack_start_s"] = round(time.monotonic() - t0, 1)
        if args.compare_rollout:
            out["rollout_compare"] = asyncio.run(compare_rollout(plan.cfg, model))
        probes = out["gpu_probe"] = [gpu_probe("before the first run")] if args.engine == "vllm" else []
        for k, spec in enumerate(args.runs):  # one run each, one after the other, same engines
            t0 = time.monotonic()
            kind = spec.label if spec.label not in runs else f"{spec.label}-{k + 1}"
            run_id = f"{RUN_ID}-{kind}"
            try:
                status, events = asyncio.run(run(plan.cfg, run_id, spec, k * args.rollouts, timeout_s=3000))
                state = {"state": str(status.state), "error": status.error}
            except Exception as exc:  # a failed run is reported; the others still run
                events, state = [], {"state": "failed", "error": f"{type(exc).__name__}: {exc}"}
            runs[kind] = (run_id, events)
            out["runs"][kind] = {"run_s": round(time.monotonic() - t0, 1), **state}
            if probes:
                probes.append(gpu_probe(f"after run {k + 1} ({kind})"))
    finally:
        sup.stop()
    for kind, (run_id, events) in runs.items():
        (work / f"events-{kind}.json").write_text(json.dumps(events, indent=1))
        metrics = work / "runs" / run_id / "metrics.jsonl"
        rows = (
            [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
        )
        out["runs"][kind] |= report(rows, push_figures(events), kind) | {"checkpoints": save_figures(events)}
    if len(out["runs"]) > 1:
        out["compared"] = compare(out["runs"])
    emit("step", **out)


if __name__ == "__main__":
    main()
