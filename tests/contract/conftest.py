"""Fixtures of the engine contract suite: one engine per session, a client per test, the HF reference.

By default the engine is the CPU reference engine, started as a real process on a free port with
the tiny kit model (built under the pytest temp dir, or under ``VIME_TEST_MODEL_CACHE``). To run
the same suite against an engine that is already running — e.g. real ``vllm serve`` on the GPU
machine, started with ``VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode --weight-transfer-config
'{"backend": "ipc"}' --logprobs-mode processed_logprobs`` (as the rollout manager starts it) — set:

- ``VIME_CONTRACT_ENGINE_URL``: its base URL;
- ``VIME_CONTRACT_MODEL_DIR``: the Hugging Face directory it serves (the tests load it with
  transformers on CPU as the ground truth for log-probs and greedy tokens);
- optionally ``VIME_CONTRACT_PUSHER=module:factory`` (see ``contract_pushers``), and
  ``VIME_CONTRACT_LOGPROB_ATOL`` / ``VIME_CONTRACT_INFLIGHT_WAIT_S``.

Nothing here needs more than httpx, pytest, torch, transformers and safetensors (plus pydantic,
which vLLM ships): without pytest-asyncio the async tests run through `pytest_pyfunc_call` below.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from contract_pushers import WeightPusher, make_pusher
from contract_support import EngineUnderTest, HFReference, logprobs_mode_of, profile_for

from vime.clients.engine import EngineClient
from vime.wire.engine import EngineVersion

ENV_URL = "VIME_CONTRACT_ENGINE_URL"
ENV_MODEL = "VIME_CONTRACT_MODEL_DIR"


def _describe(url: str, model_dir: Path) -> EngineUnderTest:
    with httpx.Client(timeout=30) as c:
        info = EngineVersion.from_body(c.get(url + "/version").json())
        served = c.get(url + "/v1/models").json()["data"][0]["id"]
    return EngineUnderTest(url, model_dir, served, info, profile_for(info), logprobs_mode_of(url))


def _start_reference_engine(tmp: pytest.TempPathFactory) -> Iterator[EngineUnderTest]:
    from vime import procs
    from vime.models.tiny import ensure_tiny_qwen3

    cache = Path(os.environ.get("VIME_TEST_MODEL_CACHE") or tmp.mktemp("models"))
    model_dir = ensure_tiny_qwen3(cache, "micro")
    port = procs.free_port()
    argv = procs.python_module(
        "vime_rollout.reference_engine",
        *("--model", str(model_dir), "--port", str(port), "--served-model-name", "tiny-micro"),
        *("--max-batch", "256", "--seed", "0"),
        *("--logprobs-mode", "processed_logprobs"),  # as the rollout manager starts its engines
    )
    child = procs.start("reference-engine", argv, log_path=tmp.mktemp("logs") / "reference-engine.log")
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_healthy(url, child, timeout_s=180)
        yield _describe(url, model_dir)
    finally:
        child.stop()


@pytest.fixture(scope="session")
def eut(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineUnderTest]:
    """The engine under test (reference engine process by default, or VIME_CONTRACT_ENGINE_URL)."""
    url = os.environ.get(ENV_URL)
    if not url:
        yield from _start_reference_engine(tmp_path_factory)
        return
    model_dir = os.environ.get(ENV_MODEL)
    if not model_dir:
        pytest.fail(f"{ENV_URL} is set: also set {ENV_MODEL} to the model directory the engine serves")
    yield _describe(url.rstrip("/"), Path(model_dir))


@pytest.fixture(scope="session")
def hf(eut: EngineUnderTest) -> HFReference:
    """The served model in this process (transformers, fp32, CPU)."""
    return HFReference(eut.model_dir)


@pytest.fixture(scope="session")
def pusher(eut: EngineUnderTest, tmp_path_factory: pytest.TempPathFactory) -> WeightPusher | None:
    return make_pusher(None, tmp_path_factory.mktemp("pusher"), eut.profile.reference)


@pytest.fixture
def need_pusher(pusher: WeightPusher | None, eut: EngineUnderTest) -> WeightPusher:
    if pusher is None:
        pytest.skip(f"no weight pusher for {eut.profile.name}: set VIME_CONTRACT_PUSHER=module:factory")
    return pusher


async def _reset(client: EngineClient) -> None:
    """Leave the engine as every test expects it: nothing in flight, awake, unpaused."""
    await client.abort_requests()
    await client.wake_up()
    await client.resume()
    await client.aclose()


def _asyncio_plugin(config: pytest.Config) -> bool:
    return bool(config.pluginmanager.hasplugin("asyncio"))


@pytest.fixture
async def _engine_async(eut: EngineUnderTest) -> AsyncIterator[EngineClient]:
    client = EngineClient(eut.url, timeout=300)
    try:
        yield client
    finally:
        await _reset(client)


@pytest.fixture
def engine(request: pytest.FixtureRequest, eut: EngineUnderTest) -> EngineClient:
    """A client of the engine under test, reset after the test (idle, awake, unpaused)."""
    if _asyncio_plugin(request.config):
        client: EngineClient = request.getfixturevalue("_engine_async")
        return client
    return EngineClient(eut.url, timeout=300)  # reset by pytest_pyfunc_call, inside the test's loop


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Without pytest-asyncio (e.g. on the GPU machine), run each async test in its own event loop."""
    test = pyfuncitem.obj
    if _asyncio_plugin(pyfuncitem.config) or not inspect.iscoroutinefunction(test):
        return None
    names = inspect.signature(test).parameters
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}

    async def run() -> None:
        try:
            await test(**kwargs)
        finally:
            if isinstance(kwargs.get("engine"), EngineClient):
                await _reset(kwargs["engine"])

    asyncio.run(run())
    return True
