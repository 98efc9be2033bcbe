"""The reference engine as a process: its command line, and its KV-cache memory budget.

Only meaningful for the reference engine (vLLM has its own flags), so these tests start their own
engine processes and do not use the engine under test.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from contract_support import EngineUnderTest

from vime import procs
from vime.clients.engine import EngineClient

MODULE = "vime_rollout.reference_engine"


@pytest.fixture
def reference_only(eut: EngineUnderTest) -> EngineUnderTest:
    if not eut.profile.reference:
        pytest.skip("tests of the reference engine's own process")
    return eut


def test_help_says_it_is_the_cpu_stand_in_for_vllm(reference_only: EngineUnderTest) -> None:
    out = subprocess.run([sys.executable, "-m", MODULE, "--help"], capture_output=True, text=True, check=True)
    assert "CPU stand-in for vLLM" in out.stdout
    for flag in (
        "--model",
        "--host",
        "--port",
        "--served-model-name",
        "--max-batch",
        "--max-model-len",
        "--seed",
        "--logprobs-mode",
        "--dtype",
        "--worker-extension-cls",
    ):
        assert flag in out.stdout


async def test_collective_rpc_and_the_version_label_routes(reference_only: EngineUnderTest) -> None:
    """vLLM's ``/collective_rpc`` body and answers (a worker without the method: 500; no method: 400) and
    0.33's ``/update_weight_version``; the suite's engine runs no worker extension."""
    async with httpx.AsyncClient(base_url=reference_only.url, timeout=60) as http:
        missing = await http.post("/collective_rpc", json={"args": []})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "method"
        unknown = await http.post("/collective_rpc", json={"method": "vime_direct_layout"})
        assert unknown.status_code == 500 and "vime_direct_layout" in unknown.json()["error"]["message"]
        private = await http.post("/collective_rpc", json={"method": "__init__"})
        assert private.status_code == 500
        before = (await http.get("/weight_info")).json()
        try:
            label = await http.post("/update_weight_version", json={"new_version": "label-only"})
            assert label.json() == {"success": True, "new_version": "label-only"}
            assert (await http.get("/weight_info")).json() == {"weight_version": "label-only"}
            bad = await http.post("/update_weight_version", json={})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "new_version"
        finally:
            await http.post("/update_weight_version", json={"new_version": before["weight_version"]})


def test_a_budget_too_small_for_one_sequence_is_refused_at_start(reference_only: EngineUnderTest) -> None:
    argv = [
        sys.executable,
        "-m",
        MODULE,
        "--model",
        str(reference_only.model_dir),
        "--kv-cache-memory-bytes",
        "64K",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--kv-cache-memory-bytes" in out.stderr and "max_model_len" in out.stderr


def test_an_unknown_logprobs_mode_is_refused_at_start(reference_only: EngineUnderTest) -> None:
    """vLLM's four modes: the reference engine serves the two log-prob ones, and says so."""
    argv = [sys.executable, "-m", MODULE, "--model", str(reference_only.model_dir), "--logprobs-mode"]
    out = subprocess.run([*argv, "raw_logits"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--logprobs-mode" in out.stderr and "processed_logprobs" in out.stderr


@pytest.fixture
def own_engine(
    reference_only: EngineUnderTest, tmp_path: Path
) -> Iterator[Callable[..., tuple[str, procs.Child]]]:
    """Start reference engines of the test's own, with extra flags; all stopped afterwards."""
    children: list[procs.Child] = []

    def start(*flags: str) -> tuple[str, procs.Child]:
        port = procs.free_port()
        argv = procs.python_module(
            MODULE, "--model", str(reference_only.model_dir), "--port", str(port), *flags
        )
        child = procs.start("reference-engine", argv, log_path=tmp_path / f"engine-{port}.log")
        children.append(child)
        url = f"http://127.0.0.1:{port}"
        procs.wait_healthy(url, child, timeout_s=180)
        return url, child

    try:
        yield start
    finally:
        for child in children:
            child.stop()


async def test_kv_budget_limits_concurrency_not_correctness(
    own_engine: Callable[..., tuple[str, procs.Child]],
) -> None:
    url, _ = own_engine("--max-model-len", "64", "--kv-cache-memory-bytes", "1M")
    sp = {"max_tokens": 40, "temperature": 1.0, "ignore_eos": True}
    async with EngineClient(url, timeout=300) as engine:
        results = await asyncio.gather(
            *(engine.generate([5 + i, 6, 7], {**sp, "seed": i}) for i in range(64))
        )
        async with httpx.AsyncClient(timeout=10) as c:
            memory = (await c.get(url + "/debug/memory")).json()
            state = (await c.get(url + "/debug/state")).json()
    assert all(len(r.token_ids) == 40 for r in results)
    # 2 KiB per position per slot (micro kit) x 64 positions: at most 8 sequences fit in 1 MiB.
    assert 0 < memory["kv_cache_bytes"] <= 1 << 20
    assert memory["kv_cache_shape"]["slots"] <= 8
    assert state["generated_tokens"] / state["steps"] > 4  # still batched


async def test_sigterm_answers_held_requests_and_exits(
    own_engine: Callable[..., tuple[str, procs.Child]],
) -> None:
    url, child = own_engine()
    async with EngineClient(url, timeout=60, retries=0) as engine:
        await engine.pause("keep")
        held = asyncio.create_task(engine.generate([5, 6, 7], {"max_tokens": 3}))
        await asyncio.sleep(0.5)
        assert not held.done()
        start = time.monotonic()
        child.popen.send_signal(signal.SIGTERM)
        result = await asyncio.wait_for(held, 30)
        assert result.finish_reason == "abort" and result.token_ids == []
        await asyncio.to_thread(child.popen.wait, 30)
    # uvicorn re-raises the signal once its graceful shutdown is done: -SIGTERM is a clean exit here.
    assert child.popen.returncode in (0, -signal.SIGTERM) and time.monotonic() - start < 15
