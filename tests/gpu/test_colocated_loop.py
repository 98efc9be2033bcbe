"""The seed's colocated loop on the GPU machine, end to end, for three rollouts.

One GPU: trainer TP=1 (Megatron, Ray actor) and one real vLLM engine share the card; two GPUs:
TP=2 and two engines. Redis, the router, the reward service (a user reward with spread, so
gradients are non-zero), the rollout manager (``engine.backend: vllm``) and the trainer service
are started as ``vime up`` starts them; the run goes over REST. Weights reach vLLM over CUDA IPC.

Checked:
- weight versions advance 1 → 2 → 3 → 4: each rollout's samples carry the version pushed before
  it, the engines hold the last one, and the engine's log-probs at the end differ from the
  checkpoint's by well more than the train/inference mismatch (the pushes really moved it);
- train/inference mismatch: the trainer recomputes the rollout's log-probs (``get_mismatch_metrics``)
  and reports mean |Δlogprob| and the fraction of tokens above 0.1 — small for every step, also
  for the steps whose weights were pushed over IPC;
- memory in the seed's order, read at each transition through a recording proxy in front of the
  rollout manager: engine memory drops at offload, the trainer takes memory during training and
  gives it back, engine weights come back before the push, the KV cache last, and the sleeping
  trainer keeps nothing of the push (per process, where NVML can tell; the total left after each
  push — vLLM's own allocator cache included — is recorded in the figures).

The dry run (``VIME_GPU_DRY_RUN=1``) runs the same loop with one reference engine, one CPU rank,
the shm transport and a tiny model; memory is then the reference engine's own account of its
weights and KV cache (the trainer's share is not measurable there and is not asserted).
"""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

import httpx
import pytest
from gpu_support import (
    EngineMemory,
    GpuMemory,
    MemorySampler,
    build_model,
    cuda_gpus,
    env_path,
    record,
)
from loop_support import (
    EXPECTED_START_ORDER,
    EXPECTED_STEP_ORDER,
    NUM_ROLLOUT,
    TOKEN,
    WEIGHT_LOAD,
    LoopStack,
    StepMemory,
    loop_config,
    split_steps,
    step_figures,
)
from rollout_proxy import RecordingProxy

from vime.clients.trainer import TrainerClient
from vime.models.tiny import num_parameters, shape_named
from vime.wire.trainer import RunState

HERE = Path(__file__).resolve().parent
PROBE = [5, 17, 30, 41, 52, 9, 12, 3]
MIB = 1 << 20
ONE_TIME_MIB = 1536  # per trainer rank: seen 484 (first TP gather) + 1172 (first step) on H200, TP=2


def checkpoint_log_probs(model: Path, tokens: list[int]) -> list[float]:
    """The checkpoint's log-probs of ``tokens`` after PROBE (transformers, fp32, CPU, teacher forcing)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = m(torch.tensor([PROBE + tokens])).logits[0, len(PROBE) - 1 : -1].float()
    lp = logits.log_softmax(-1)
    return [float(lp[i, t]) for i, t in enumerate(tokens)]


def engine_greedy(url: str, n: int) -> tuple[list[int], list[float]]:
    """The engine's greedy continuation of PROBE and its log-probs."""
    sp = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True, "logprobs": 1}
    body = {"token_ids": PROBE, "sampling_params": sp}
    out = httpx.post(url + "/inference/v1/generate", json=body, timeout=120).json()["choices"][0]
    return list(out["token_ids"]), [float(c["logprob"]) for c in out["logprobs"]["content"]]


async def run_to_end(trainer_url: str, proxy_url: str, timeout_s: float) -> tuple[Any, list[dict[str, Any]]]:
    async with TrainerClient(trainer_url, token=TOKEN, timeout=60) as client:
        await client.start_run({"services": {"rollout_url": proxy_url}}, run_id="gpu-loop")
        status = await client.wait_run("gpu-loop", timeout_s=timeout_s, poll_s=1.0)
        events = [e.model_dump() for e in (await client.events("gpu-loop")).events]
    return status, events


@pytest.mark.timeout(1200)
def test_colocated_loop_three_rollouts(gpu: bool, tmp_path: Path) -> None:
    gpus = min(cuda_gpus(), 2) if gpu else 0
    shape = "qwen3-0.6b" if gpu else "micro"
    model = build_model(tmp_path / "model", shape, gpu=gpu)
    n_params = num_parameters(shape_named(shape))
    with env_path("PYTHONPATH", HERE):  # the reward service imports gpu_rewards
        stack = LoopStack.start(loop_config(tmp_path, model, gpus))
    try:
        engines = httpx.get(stack.url("rollout") + "/v1/engines", timeout=30).json()["engines"]
        urls = [e["url"] for e in engines]
        gpu_memory = GpuMemory(list(range(gpus))) if gpu else None
        probe = gpu_memory.used if gpu_memory else EngineMemory(urls).used
        detail = gpu_memory.by_process if gpu_memory else None
        with MemorySampler(probe) as sampler, RecordingProxy(stack.url("rollout"), probe, detail) as proxy:
            status, events = asyncio.run(run_to_end(stack.url("trainer"), proxy.url, 900))
        tokens, engine_lp = engine_greedy(urls[0], 8)
        engines = httpx.get(stack.url("rollout") + "/v1/engines", timeout=30).json()["engines"]
    finally:
        stack.stop()
    (tmp_path / "proxy_calls.json").write_text(json.dumps(proxy.dump(), indent=1))
    rows = [
        json.loads(x) for x in (tmp_path / "runs" / "gpu-loop" / "metrics.jsonl").read_text().splitlines()
    ]
    drift = statistics.fmean(
        abs(a - b) for a, b in zip(engine_lp, checkpoint_log_probs(model, tokens), strict=True)
    )
    steps = split_steps(proxy.calls)
    memory = [step_figures(s, peak_in_train(s, sampler)) for s in steps]
    report(rows, memory, status, gpus)
    record("loop_drift", engine_vs_checkpoint_mean_abs_logprob=drift)
    assert status.state == RunState.FINISHED, status.error

    problems = check_versions(rows, status, engines) + check_mismatch(rows, gpu)
    worst = max((r.get("train/mismatch_mean_abs") or 0.0 for r in rows), default=0.0)
    if drift < max(0.01, 2 * worst):  # the pushes moved the engine well beyond train/inference noise
        problems.append(
            f"the engine's log-probs moved only {drift:.4f} from the checkpoint's (mismatch {worst:.4f})"
        )
    if not all(r["train/grad_norm"] > 0 for r in rows):
        problems.append(f"zero gradients: {[r['train/grad_norm'] for r in rows]}")
    if steps[0].order() != EXPECTED_START_ORDER:
        problems.append(f"start-up calls out of order: {steps[0].order()}")
    for step in steps[1:]:
        if step.order() != EXPECTED_STEP_ORDER:
            problems.append(f"rollout {step.rollout_id} calls out of order: {step.order()}")
    weight_bytes = (2 if gpu else 4) * n_params * max(gpus, 1)
    ranks = max(gpus, 1)
    for k, step in enumerate(steps):  # start-up and rollout 0 may pay the one-time costs
        # (no allowance for the direct load's staging buffers: they are freed after every push)
        problems += check_memory(step, sampler, gpu, weight_bytes, ONE_TIME_MIB * ranks if k < 2 else 0)
    loads = [e["detail"].get("weight_load") for e in events if e["action"] == "weights.loaded"]
    if len(loads) != NUM_ROLLOUT + 1:
        problems.append("not one push at start-up and one per rollout")
    if set(loads) != {WEIGHT_LOAD}:
        refused = [e["detail"] for e in events if e["action"] == "weights.direct_refused"]
        problems.append(f"engine.weight_load={WEIGHT_LOAD} but the pushes were loaded by {loads} ({refused})")
    record("loop_pushes", weight_load=WEIGHT_LOAD, **push_figures(rows))
    record("loop_problems", problems=problems)
    assert not problems, "\n".join(problems)


def push_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each step's push: pause → resume and its phases (``weights/<phase>_s``), and T_weight_sync."""
    return {
        "steps": [
            {k: round(v, 4) for k, v in r.items() if k.startswith("weights/") or k == "perf/T_weight_sync"}
            for r in rows
        ]
    }


def peak_in_train(step: StepMemory, sampler: MemorySampler) -> int | None:
    off, done = step.first("POST /v1/engines/offload"), step.first("POST /v1/training-completed")
    return None if off is None or done is None else sampler.peak(off.t1, done.t0)


def report(rows: list[dict[str, Any]], memory: list[dict[str, Any]], status: Any, gpus: int) -> None:
    keep = (
        "train/mismatch_mean_abs",
        "train/mismatch_frac_above",
        "train/mismatch_tokens",
        "train/grad_norm",
    )
    keep += ("batch/weight_version_min", "batch/weight_version_max", "rollout/reward_std")
    record(
        "loop",
        gpus=gpus,
        state=status.state,
        error=status.error,
        weight_version=status.weight_version,
        steps=[
            {
                "rollout_id": r["rollout_id"],
                "weight_version": r["weight_version"],
                **{k.split("/", 1)[1]: r.get(k) for k in keep},
                **{k.removeprefix("perf/"): round(v, 3) for k, v in r.items() if k.startswith("perf/T_")},
            }
            for r in rows
        ],
        memory=memory,
    )


def check_versions(rows: list[dict[str, Any]], status: Any, engines: list[dict[str, Any]]) -> list[str]:
    """Rollout k generated with version k+1 and pushed k+2; the engines hold the last one."""
    problems = []
    if [r["rollout_id"] for r in rows] != list(range(NUM_ROLLOUT)):
        problems.append(f"steps recorded: {[r['rollout_id'] for r in rows]}")
    for k, r in enumerate(rows):
        versions = (r.get("batch/weight_version_min"), r.get("batch/weight_version_max"), r["weight_version"])
        if versions != (k + 1, k + 1, k + 2):
            problems.append(f"rollout {k}: samples of versions {versions[:2]}, pushed {versions[2]}")
    held = [e["weight_version"] for e in engines]
    if status.weight_version != NUM_ROLLOUT + 1 or held != [NUM_ROLLOUT + 1] * len(engines):
        problems.append(f"final version {status.weight_version}, engines hold {held}")
    return problems


def check_mismatch(rows: list[dict[str, Any]], gpu: bool) -> list[str]:
    """bf16 engines vs bf16 Megatron on the same weights: small; fp32 on CPU: tiny."""
    mean_bound, frac_bound = (0.1, 0.2) if gpu else (1e-3, 0.0)
    problems = []
    for r in rows:
        mean, frac = r.get("train/mismatch_mean_abs"), r.get("train/mismatch_frac_above")
        if not r.get("train/mismatch_tokens") or mean is None or frac is None:
            problems.append(f"rollout {r['rollout_id']}: no mismatch metrics")
        elif mean > mean_bound or frac > frac_bound:
            problems.append(f"rollout {r['rollout_id']}: mismatch mean |Δ| {mean:.4f}, {frac:.1%} above 0.1")
    return problems


def check_memory(
    step: StepMemory, sampler: MemorySampler, gpu: bool, weight_bytes: int, one_time_mib: int
) -> list[str]:
    """The seed's memory order at this step's transitions (start-up: the last four only).

    ``one_time_mib``: what the asleep trainer may keep the first time a path runs (NCCL
    communicators of a group's first collective, lazily loaded kernels); later steps get none.
    """
    name = f"rollout {step.rollout_id}" if step.rollout_id is not None else "start-up"
    w_on = step.first("POST /v1/engines/onload(weights)")
    kv_on = step.first("POST /v1/engines/onload(kv_cache")
    loaded = step.first("POST /v1/engines/weights-loaded")
    if not (w_on and kv_on and loaded) or None in (
        w_on.before,
        w_on.after,
        kv_on.before,
        kv_on.after,
        loaded.after,
    ):
        return [f"{name}: memory transitions missing"]
    problems = []
    if w_on.after - w_on.before < weight_bytes // 2:
        problems.append(
            f"{name}: engine weights did not come back before the push ({w_on.before} → {w_on.after})"
        )
    kept = trainer_mib(loaded.detail) - trainer_mib(w_on.detail) if loaded.detail and w_on.detail else None
    if gpu and kept is not None and kept > 256 + one_time_mib:  # the asleep trainer gives back the push
        problems.append(
            f"{name}: the trainer kept {kept} MiB after the push "
            f"(MiB per process before: {w_on.detail}, after: {loaded.detail})"
        )
    if gpu and w_on.detail and kv_on.detail:  # the weights the sleep kept for the push went after it
        dropped_mib = trainer_mib(w_on.detail) - trainer_mib(kv_on.detail)
        if dropped_mib + one_time_mib < (weight_bytes >> 20) // 2:
            problems.append(
                f"{name}: the trainer gave back only {dropped_mib} MiB after the push "
                f"(MiB per process at the weights' wake-up: {w_on.detail}, at the KV cache's: {kv_on.detail})"
            )
    if step.rollout_id is None:
        return problems
    off, done = step.first("POST /v1/engines/offload"), step.first("POST /v1/training-completed")
    if not (off and done) or None in (off.before, off.after, done.before):
        return [*problems, f"{name}: offload or training-completed not recorded"]
    dropped = off.before - off.after
    if off.after >= off.before / 2 or dropped < weight_bytes:
        problems.append(f"{name}: offload freed only {dropped >> 20} MiB ({off.before} → {off.after})")
    if gpu:
        if kv_on.after - kv_on.before < (dropped - weight_bytes) // 2:
            problems.append(
                f"{name}: KV woke with {(kv_on.after - kv_on.before) >> 20} of {dropped >> 20} MiB"
            )
        peak = sampler.peak(off.t1, done.t0)
        problems += trainer_memory(name, off.after, done.before, peak, weight_bytes, one_time_mib)
    return problems


def trainer_mib(detail: dict[str, int]) -> int:
    """MiB held by the trainer's ranks (Ray workers are titled ``ray::...``) in an NVML breakdown."""
    return sum(mib for proc, mib in detail.items() if proc.split(" ", 1)[-1].startswith("ray::"))


def trainer_memory(
    name: str, engines_off: int, trained: int, peak: int | None, weight_bytes: int, one_time_mib: int
) -> list[str]:
    """While the engines sleep the trainer takes memory (≥ bf16 weights + grads) and gives it back,
    all but its bf16 weights, which the push reads on the GPU before they go too (`check_memory`)."""
    if peak is None:
        return [f"{name}: no memory sample during training"]
    taken, kept = peak - engines_off, trained - engines_off
    problems = []
    if taken < 2 * weight_bytes:
        problems.append(f"{name}: the trainer took only {taken >> 20} MiB while training")
    if kept > weight_bytes + (256 + one_time_mib) * MIB + taken // 10:
        problems.append(f"{name}: {kept >> 20} MiB still held after the trainer slept")
    return problems
