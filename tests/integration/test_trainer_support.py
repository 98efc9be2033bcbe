"""Helpers of the trainer loop's integration test (no tests in this module): the whole stack as
real processes on free ports, a watcher of the engines' own sleep states, the probes and the checks
of a step's order of actions against the seed."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.run_events import SAVE, STEP, SYNC, TRAIN, TRAINED, action_names
from vime import procs
from vime.clients.trainer import TrainerClient

TOKEN = "it-trainer-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REWARD_MODULE = """
import zlib


def reward(req):
    return float(zlib.crc32((req.response or "").encode()) % 2)
"""
PROBE = {
    "token_ids": [5, 17, 30, 41, 52, 9],
    "sampling_params": {"max_tokens": 12, "temperature": 0.0, "logprobs": 1},
}


def run_config(work: Path, redis_url: str, tp: int) -> dict[str, Any]:
    prompts = work / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i % 7}=", "label": str(i + i % 7)}) + "\n" for i in range(40))
    )
    (work / "trainer_it_rewards.py").write_text(REWARD_MODULE)
    ports = {n: procs.free_port() for n in ("router", "router_control", "reward", "rollout", "trainer")}
    return {
        "run_id": f"it-{uuid.uuid4().hex[:8]}",
        "output_dir": str(work / "runs"),
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 4,
        "rollout_max_prompt_len": 16,
        "rollout_max_response_len": 12,
        "rollout_max_context_len": 64,
        "rollout_num_gpus": 0,
        "rollout_num_engines_cpu": 2,
        "vllm_server_concurrency": 8,
        "actor_num_gpus_per_node": 0,
        "actor_num_cpu_ranks": tp,
        "tensor_model_parallel_size": tp,
        "micro_batch_size": 4,
        "num_rollout": 3,
        "colocate": True,
        "model": {"tiny_model_size": "micro"},
        "data": {"prompt_data": str(prompts), "rollout_shuffle": False},
        "reward": {"custom_rm_path": "trainer_it_rewards:reward", "num_workers": 1},
        "engine": {
            "backend": "reference",
            "base_port": procs.free_port_run(2),
            "startup_timeout_s": 300,
            "health_check_interval_s": 0.5,
        },
        "trainer": {"lr": 3e-3, "checkpoint_dir": str(work / "ckpt"), "weight_dir": str(work / "shm")},
        "services": {
            "host": "127.0.0.1",
            **{f"{k}_port": v for k, v in ports.items()},
            "redis_url": redis_url,
            "api_token": TOKEN,
        },
    }


@dataclass
class Stack:
    cfg: dict[str, Any]
    work: Path
    rollout_url: str
    trainer_url: str
    children: list[procs.Child]

    def trainer(self) -> TrainerClient:
        return TrainerClient(self.trainer_url, token=TOKEN)

    def engines(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.rollout_url + "/v1/engines", timeout=30).json()["engines"])


@dataclass
class EngineWatch:
    """Polls every engine's own state (the reference engine's /debug/state) while a run goes on."""

    urls: list[str]
    seen: dict[str, list[tuple[tuple[str, ...], str | None]]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> EngineWatch:
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.thread.join(10)

    def _poll(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                for url in self.urls:
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        s = client.get(url + "/debug/state").json()
                        obs = (tuple(s["sleeping_tags"]), s["weight_version"])
                        seq = self.seen.setdefault(url, [])
                        if not seq or seq[-1] != obs:
                            seq.append(obs)
                time.sleep(0.01)


def start_stack(work: Path, redis_url: str, tp: int, models: Path) -> Stack:
    cfg = run_config(work, redis_url, tp)
    cfg_path = work / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    logs, s = work / "logs", cfg["services"]
    env = {
        "VIME_MODEL_CACHE": str(models),
        "PYTHONPATH": os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")]),
    }
    children: list[procs.Child] = []

    def start(name: str, module: str, *extra: str) -> procs.Child:
        argv = procs.python_module(module, "--config", str(cfg_path), *extra)
        children.append(procs.start(name, argv, log_path=logs / f"{name}.log", env=env))
        return children[-1]

    try:
        reward, router = (
            start("reward", "vime_reward"),
            start("router", "vime_router", "--log-dir", str(logs)),
        )
        trainer = start("trainer", "vime_trainer")
        procs.wait_healthy(f"http://127.0.0.1:{s['reward_port']}", reward, timeout_s=120)
        procs.wait_healthy(f"http://127.0.0.1:{s['router_control_port']}", router, timeout_s=120)
        manager = start("rollout", "vime_rollout", "--log-dir", str(logs))
        rollout_url, trainer_url = (
            f"http://127.0.0.1:{s['rollout_port']}",
            f"http://127.0.0.1:{s['trainer_port']}",
        )
        procs.wait_healthy(trainer_url, trainer, timeout_s=120)
        procs.wait_healthy(rollout_url, manager, timeout_s=300)
    except BaseException:
        stop_children(children, [])
        raise
    return Stack(cfg, work, rollout_url, trainer_url, children)


def stop_children(children: list[procs.Child], engine_pids: list[int]) -> None:
    for child in reversed(children):
        child.stop(grace_s=30)
    for pid in engine_pids:  # in case the manager could not stop them itself
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def safe_engines(st: Stack) -> list[dict[str, Any]]:
    with contextlib.suppress(Exception):
        return st.engines()
    return []


def probe(url: str) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs for a fixed prompt: the same weights answer the same."""
    out = httpx.post(url + "/inference/v1/generate", json=PROBE, timeout=60).json()["choices"][0]
    return out["token_ids"], [round(c["logprob"], 5) for c in out["logprobs"]["content"]]


def run_events(stack: Stack, run_id: str) -> list[dict[str, Any]]:
    return [e.model_dump() for e in asyncio.run(call(stack, lambda c: c.events(run_id))).events]


async def call(stack: Stack, fn: Any) -> Any:
    async with stack.trainer() as c:
        return await fn(c)


def actions(events: list[dict[str, Any]], rollout_id: int | None) -> list[str]:
    """The action names of one rollout's events (a stop request may land anywhere: left out)."""
    return action_names(
        e for e in events if e["rollout_id"] == rollout_id and e["action"] != "run.stop_requested"
    )


ALLOWED = {
    ((), ("kv_cache", "weights")),
    (("kv_cache", "weights"), ("kv_cache",)),
    (("kv_cache",), ()),
    (("kv_cache", "weights"), ()),
}
"""Engine sleep-state moves: offload; weights wake; KV wakes (or both, when a poll missed the middle)."""


def check_step_order(events: list[dict[str, Any]], rollout_id: int, *, saved: str) -> None:
    """The step's actions in the seed's order; ``saved``: where its checkpoint is (``after_train``,
    where the trainer is awake and the engines asleep; ``after_step`` for a stop that came later;
    ``either``; ``no``)."""
    got = actions(events, rollout_id)
    resume = [] if rollout_id == 2 else ["admission.resume"]
    body = [*SYNC, *resume, "engines.onload(kv_cache)", "step.done"]
    after_train = [*TRAIN, *SAVE, *TRAINED, *body]  # one wake and one sleep for the step
    after_step = [*STEP, *body, "trainer.wake_up", *SAVE, "trainer.sleep"]
    want = {
        "after_train": [after_train],
        "after_step": [after_step],
        "either": [after_train, after_step],
        "no": [[*STEP, *body]],
    }[saved]
    assert got in want, got


def check_engine_states(watch: EngineWatch) -> None:
    for url, seq in watch.seen.items():
        states = [tags for tags, _ in seq]
        assert ("weights",) not in states, f"{url}: KV awake while weights asleep: {seq}"
        moves = {(a, b) for a, b in itertools.pairwise(states) if a != b}
        assert moves <= ALLOWED, f"{url}: unexpected sleep-state moves {moves - ALLOWED}: {seq}"
        versions = [int(v) for _, v in seq if v is not None]
        assert versions == sorted(versions), f"{url}: versions went back: {seq}"


def wait_first_step(stack: Stack, run_id: str) -> None:
    """Until the loop is past start-up (on rollout 0, or 1 on a slow poll)."""
    deadline = time.monotonic() + 600
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline:
            s = client.get(f"{stack.trainer_url}/v1/runs/{run_id}").json()
            assert s["state"] in ("running", "stopping"), s
            if s["rollout_id"] is not None:
                return
            time.sleep(0.02)
    raise AssertionError("the run never got past start-up")
