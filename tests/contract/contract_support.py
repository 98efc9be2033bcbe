"""Helpers of the engine contract suite: the engine profile, the HF reference, waits, memory probes.

The suite runs the same checks against the CPU reference engine and against real vLLM. Where the
two legitimately differ, the difference is a field of `EngineProfile` (chosen from the engine's
own ``GET /version``) and the tests assert the behaviour of the engine in front of them — both
branches are real assertions, documented here:

==============================  =====================  ===============  ============================
behaviour                       reference engine       vLLM 0.26        vLLM 0.33 (from code only)
==============================  =====================  ===============  ============================
weight version in responses     spans, once one is set none at all      spans ("default" at start)
unknown request fields          400 naming them        ignored (200)    ignored (200)
weight-update protocol misuse   400                    500              500
request arriving during pause   held until resume      held             503 in abort/wait, held keep
sleep level outside 0..2        400                    not tested       400
stream=true                     400 (not implemented)  SSE chunks       SSE chunks
update while weights asleep     400 (guarded)          no guard: n/t    no guard: n/t
penalties, logit_bias, ...      400 unless default     supported: n/t   supported: n/t
weight transport                shm safetensors files  CUDA IPC         CUDA IPC  (pusher seam)
memory check                    /debug/memory (RSS)    nvidia-smi       nvidia-smi
log-prob tolerance vs HF fp32   1e-3                   0.15 (bf16)      0.15 (bf16)
--logprobs-mode                 processed_logprobs     /server_info     /server_info
same tokens whatever the batch  exact                  not asserted     not asserted
/metrics in-flight gauges       exact values           present: n/t     present: n/t
==============================  =====================  ===============  ============================

"n/t": not tested against that engine (the reference-engine side is). Everything else in the
suite is the same assertion for every engine. What a reported log-prob means is the engine's
``--logprobs-mode`` (read from vLLM's dev-mode ``GET /server_info?config_format=json``, or
``VIME_CONTRACT_LOGPROBS_MODE``): the suite's reference engine runs ``processed_logprobs``, as the
rollout manager launches every engine, and the log-prob tests check whichever mode is reported.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from vime.clients.engine import EngineClient
from vime.retry import poll_until
from vime.wire.engine import EngineVersion, logprobs_mode_in


@dataclass(frozen=True)
class EngineProfile:
    """How the engine under test is expected to behave where engines differ (see the module table)."""

    name: str
    reference: bool
    reports_weight_version: bool
    rejects_unknown_fields: bool
    protocol_error_status: int
    holds_requests_in_abort_pause: bool
    logprob_atol: float
    exact_numerics: bool


def profile_for(info: EngineVersion) -> EngineProfile:
    """The profile of the engine that answered ``/version``; env VIME_CONTRACT_LOGPROB_ATOL overrides the tolerance."""
    atol_env = os.environ.get("VIME_CONTRACT_LOGPROB_ATOL")
    if info.is_reference:
        profile = EngineProfile("reference", True, True, True, 400, True, 1e-3, True)
    else:
        profile = EngineProfile(
            f"vllm-{info.version}",
            reference=False,
            reports_weight_version=info.reports_weight_version,
            rejects_unknown_fields=False,
            protocol_error_status=500,
            holds_requests_in_abort_pause=not info.rejects_requests_while_paused,
            logprob_atol=0.15,
            exact_numerics=False,
        )
    if atol_env:
        profile = EngineProfile(**{**profile.__dict__, "logprob_atol": float(atol_env)})
    return profile


@dataclass
class EngineUnderTest:
    url: str
    model_dir: Path
    served_name: str
    info: EngineVersion
    profile: EngineProfile
    logprobs_mode: str = "raw_logprobs"
    """What its log-probs are: ``raw_logprobs`` (before temperature) or ``processed_logprobs``."""


def logprobs_mode_of(url: str) -> str:
    """The engine's ``--logprobs-mode``: VIME_CONTRACT_LOGPROBS_MODE, else vLLM's dev-mode
    ``/server_info`` (the reference engine serves it too), else vLLM's default ``raw_logprobs``."""
    override = os.environ.get("VIME_CONTRACT_LOGPROBS_MODE")
    if override:
        return override
    with httpx.Client(timeout=120) as c:  # vLLM collects its environment report for this route
        r = c.get(url + "/server_info", params={"config_format": "json"})
    if r.status_code == 404:
        return "raw_logprobs"
    try:
        mode = logprobs_mode_in(r.json())
    except ValueError:  # not JSON
        mode = None
    if mode is None:
        raise RuntimeError(
            f"GET {url}/server_info answered {r.status_code} without model_config.logprobs_mode: "
            "set VIME_CONTRACT_LOGPROBS_MODE to the engine's --logprobs-mode"
        )
    return mode


class HFReference:
    """The served model, loaded with transformers in the test process: the ground truth for log-probs."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.original = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    @torch.inference_mode()
    def logprobs(
        self, prompt: Sequence[int], tokens: Sequence[int], temperature: float = 1.0
    ) -> torch.Tensor:
        """``[len(tokens), vocab]`` log-softmax of logits / T at each generated position (teacher forcing)."""
        ids = torch.tensor([list(prompt) + list(tokens)])
        logits = self.model(ids).logits[0].float()
        return (logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)] / temperature).log_softmax(-1)

    def token_logprobs(
        self, prompt: Sequence[int], tokens: Sequence[int], temperature: float = 1.0
    ) -> list[float]:
        lp = self.logprobs(prompt, tokens, temperature)
        return [float(lp[i, t]) for i, t in enumerate(tokens)]

    @torch.inference_mode()
    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            logits = self.model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        return ids[len(prompt) :]

    @torch.inference_mode()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        for name, t in tensors.items():
            params[name].copy_(t)

    def restore(self) -> None:
        self.load(self.original)


async def wait_for(
    predicate: Callable[[], Awaitable[bool]], timeout: float = 30.0, interval: float = 0.02
) -> None:
    await poll_until(predicate, timeout_s=timeout, interval_s=interval, what="the condition")


async def debug_state(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as c:
        return dict((await c.get(url + "/debug/state")).json())


async def until_running(
    eut: EngineUnderTest, count: int = 1, min_tokens: int = 1, tasks: Sequence[asyncio.Task[Any]] = ()
) -> None:
    """Wait until ``count`` sequences are being decoded (reference: asked; vLLM: a fixed grace period).

    ``tasks`` are the requests being waited for: if one finishes first, the request was too short
    for this machine and the test says so instead of waiting for nothing.
    """
    if not eut.profile.reference:
        await asyncio.sleep(float(os.environ.get("VIME_CONTRACT_INFLIGHT_WAIT_S", "0.5")))
        return
    async with httpx.AsyncClient(base_url=eut.url, timeout=10) as c:
        start = (await c.get("/debug/state")).json()["generated_tokens"]

        async def ready() -> bool:
            done = [t for t in tasks if t.done()]
            if done:
                raise AssertionError(f"a request finished before it was seen running: {done[0]}")
            state = (await c.get("/debug/state")).json()
            return bool(state["running"] >= count and state["generated_tokens"] - start >= min_tokens)

        await wait_for(ready)


async def memory_used(eut: EngineUnderTest) -> dict[str, int] | None:
    """Memory readings: the reference engine's /debug/memory, nvidia-smi for vLLM, None if neither."""
    if eut.profile.reference:
        async with httpx.AsyncClient(timeout=10) as c:
            return dict((await c.get(eut.url + "/debug/memory")).json())
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {"gpu_used_bytes": sum(int(x) for x in out.split()) * 1024 * 1024}


async def greedy(engine: EngineClient, prompt: Sequence[int], n: int, **extra: Any) -> list[int]:
    sp = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True, **extra}
    return (await engine.generate(prompt, sp)).token_ids
