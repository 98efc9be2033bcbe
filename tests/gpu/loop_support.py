"""Helpers of the colocated-loop GPU test (no tests here): its run config, the stack (started with
`vime.launch`, as ``vime up`` starts it), and the reading of the memory record per step.

The stack is the seed's scenario scaled to the machine: one GPU — trainer TP=1 and one vLLM
engine sharing it; two GPUs — trainer TP=2 and two engines. In the dry run: one reference engine
and one CPU rank on a tiny model.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rollout_proxy import Call

from vime import procs
from vime.config import load_config
from vime.launch.signals import SignalLatch
from vime.launch.stack import StackPlan, plan_stack
from vime.launch.supervisor import Supervisor

TOKEN = "gpu-loop-token"
WEIGHT_LOAD = os.environ.get("VIME_GPU_WEIGHT_LOAD", "direct")
"""``engine.weight_load`` of the loop: ``direct``, what ``auto`` picks on one GPU (the suite's
``loop_vllm`` step sets ``vllm``)."""
NUM_ROLLOUT = 3
PROMPTS = [f"{a}+{b}=" for a in range(1, 9) for b in range(1, 9)]


def write_prompts(work: Path) -> Path:
    path = work / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": "0"}) + "\n" for p in PROMPTS))
    return path


def loop_config(work: Path, model: Path, gpus: int) -> dict[str, Any]:
    """The run config; ``gpus`` 0 is the CPU dry run."""
    if gpus:
        layout: dict[str, Any] = {
            "rollout_num_gpus": gpus,
            "actor_num_gpus_per_node": gpus,
            "tensor_model_parallel_size": gpus,
            "rollout_batch_size": 8,
            "n_samples_per_prompt": 8,
            "micro_batch_size": 8,
            "rollout_max_response_len": 48,
        }
        engine = {"backend": "vllm", "gpu_memory_utilization": 0.3, "enforce_eager": True}
    else:
        layout = {
            "rollout_num_gpus": 0,
            "rollout_num_engines_cpu": 1,
            "actor_num_gpus_per_node": 0,
            "actor_num_cpu_ranks": 1,
            "tensor_model_parallel_size": 1,
            "rollout_batch_size": 4,
            "n_samples_per_prompt": 4,
            "micro_batch_size": 4,
            "rollout_max_response_len": 16,
        }
        engine = {"backend": "reference"}
    ports = {
        f"{n}_port": procs.free_port() for n in ("router", "router_control", "reward", "rollout", "trainer")
    }
    return {
        **layout,
        "run_id": "gpu-loop",
        "output_dir": str(work / "runs"),
        "num_rollout": NUM_ROLLOUT,
        "num_steps_per_rollout": 1,
        "rollout_num_gpus_per_engine": 1,
        "rollout_max_prompt_len": 16,
        "rollout_max_context_len": 96,
        "vllm_server_concurrency": 64,
        "colocate": True,
        "get_mismatch_metrics": True,
        "model": {"hf_checkpoint": str(model), "served_model_name": "loop-model"},
        "data": {"prompt_data": str(write_prompts(work)), "rollout_shuffle": False},
        "reward": {"custom_rm_path": "gpu_rewards:even_characters", "num_workers": 2},
        "engine": {
            **engine,
            "base_port": _engine_base(),
            "startup_timeout_s": 420,
            "health_check_interval_s": 1.0,
            "weight_load": WEIGHT_LOAD,
        },
        "trainer": {"lr": 1e-3, "checkpoint_dir": str(work / "ckpt")},
        "services": {"host": "127.0.0.1", **ports, "api_token": TOKEN},
    }


def _engine_base() -> int:
    from gpu_support import engine_port

    return engine_port()


@dataclass
class LoopStack:
    """The stack's processes (redis, router, reward, rollout manager + engines, trainer)."""

    plan: StackPlan
    sup: Supervisor

    @classmethod
    def start(cls, cfg: dict[str, Any]) -> LoopStack:
        plan = plan_stack(load_config(base=cfg, environ={}))
        sup = Supervisor(plan, Console(stderr=True), SignalLatch())
        try:
            sup.start()
        except BaseException:
            sup.stop()
            raise
        return cls(plan, sup)

    def url(self, name: str) -> str:
        return self.plan.cfg.services.url(name)  # type: ignore[arg-type]

    def stop(self) -> None:
        self.sup.stop()


# --- the memory record ------------------------------------------------------------------------


@dataclass
class StepMemory:
    """The memory record of one step (or of start-up, ``rollout_id`` None), in call order."""

    rollout_id: int | None
    calls: list[Call] = field(default_factory=list)

    def first(self, route: str) -> Call | None:
        return next((c for c in self.calls if c.route.startswith(route)), None)

    def order(self) -> list[str]:
        keep = ("/v1/engines/offload", "/v1/engines/onload", "/v1/engines/update-lock")
        keep += ("/v1/engines/weights-loaded", "/v1/training-completed", "/v1/rollouts")
        routes = [
            c.route.split(" ", 1)[1] for c in self.calls if c.method == "POST" and c.path.startswith(keep)
        ]
        return [re.sub(r"/\d+$", "", r) for r in routes]


def split_steps(calls: list[Call]) -> list[StepMemory]:
    """Calls grouped by step: each ``POST /v1/rollouts`` (a training rollout) opens a new one."""
    steps = [StepMemory(None)]
    for call in calls:
        body = call.body if isinstance(call.body, dict) else {}
        if (
            call.method == "POST"
            and call.path.startswith("/v1/rollouts")
            and not body.get("evaluation", True)
        ):
            steps.append(StepMemory(int(body["rollout_id"])))
        steps[-1].calls.append(call)
    return steps


EXPECTED_STEP_ORDER = [
    "/v1/rollouts",
    "/v1/engines/offload",
    "/v1/training-completed",
    "/v1/engines/onload(weights)",
    "/v1/engines/update-lock",
    "/v1/engines/weights-loaded",
    "/v1/engines/onload(kv_cache,cuda_graph)",
]
EXPECTED_START_ORDER = [
    "/v1/engines/onload(weights)",
    "/v1/engines/update-lock",
    "/v1/engines/weights-loaded",
    "/v1/engines/onload(kv_cache,cuda_graph)",
]


def step_figures(step: StepMemory, peak_in_train: int | None) -> dict[str, Any]:
    """The memory readings (GiB) at each transition of one step."""
    gib = float(1 << 30)

    def at(route: str, which: str) -> float | None:
        call = step.first(route)
        value = None if call is None else getattr(call, which)
        return None if value is None else round(value / gib, 3)

    out = {
        "rollout_end": at("POST /v1/rollouts", "after"),
        "offload_before": at("POST /v1/engines/offload", "before"),
        "offload_after": at("POST /v1/engines/offload", "after"),
        "train_peak": None if peak_in_train is None else round(peak_in_train / gib, 3),
        "trained_and_asleep": at("POST /v1/training-completed", "before"),
        "weights_before": at("POST /v1/engines/onload(weights)", "before"),
        "weights_after": at("POST /v1/engines/onload(weights)", "after"),
        "pushed": at("POST /v1/engines/weights-loaded", "after"),
        "per_process_mib_after_push": getattr(step.first("POST /v1/engines/weights-loaded"), "detail", None),
        "kv_before": at("POST /v1/engines/onload(kv_cache", "before"),
        "kv_after": at("POST /v1/engines/onload(kv_cache", "after"),
    }
    return {"rollout_id": step.rollout_id, "gib": out}
