"""vime's vLLM launcher (`vllm_ext.serve`) with a fake vLLM: the compact route and the quick pause."""

from __future__ import annotations

import asyncio
import sys
import types
from typing import Any

import pytest
from vime_rollout.vllm_ext import quick_pause, serve


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> types.ModuleType:
    """vLLM's two modules the launcher touches: the API server's ``build_app`` and the CLI's ``main``."""
    api_server = types.ModuleType("vllm.entrypoints.openai.api_server")
    api_server.build_app = lambda *a, **k: calls.append("build_app") or "app"  # type: ignore[attr-defined]
    cli = types.ModuleType("vllm.entrypoints.cli.main")

    def vllm_main() -> None:
        calls.append(f"main:{api_server.build_app()}")  # type: ignore[attr-defined]

    cli.main = vllm_main  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.entrypoints", "vllm.entrypoints.openai", "vllm.entrypoints.cli"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.openai.api_server", api_server)
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.main", cli)
    return api_server


class _EngineCore:
    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    async def pause_scheduler_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(("pause_scheduler", mode, clear_cache))


class _Renderer:
    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    async def clear_mm_cache_async(self) -> None:
        self.calls.append("clear_mm_cache")


def _fake_async_llm(monkeypatch: pytest.MonkeyPatch, calls: list[Any], *, vllm_026: bool = True) -> type:
    """``vllm.v1.engine.async_llm.AsyncLLM`` with 0.26's ``pause_generation`` (or another one)."""

    class AsyncLLM:
        def __init__(self) -> None:
            self.engine_core, self.renderer = _EngineCore(calls), _Renderer(calls)

        if vllm_026:

            async def pause_generation(
                self,
                *,
                mode: str = "abort",
                wait_for_inflight_requests: bool | None = None,
                clear_cache: bool = True,
            ) -> None:
                calls.append("vllm's own")

        else:

            async def pause_generation(self, *, mode: str = "abort") -> None:  # type: ignore[misc]
                calls.append("vllm's own")

    module = types.ModuleType("vllm.v1.engine.async_llm")
    module.AsyncLLM = AsyncLLM  # type: ignore[attr-defined]
    for name in ("vllm.v1", "vllm.v1.engine"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", module)
    return AsyncLLM


def test_the_launcher_adds_the_route_to_the_app_vllm_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    _fake_vllm(monkeypatch, calls)
    route = types.ModuleType("vime_rollout.vllm_ext.compact_generate")
    route.attach = lambda app: calls.append(f"attach:{app}") or "app+route"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vime_rollout.vllm_ext.compact_generate", route)
    serve.main()
    assert calls == ["build_app", "attach:app", "main:app+route"]


def test_the_launcher_serves_without_the_route_where_it_cannot_be_imported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []
    _fake_vllm(monkeypatch, calls)  # a vLLM without the serving classes the route reuses
    monkeypatch.delitem(sys.modules, "vime_rollout.vllm_ext.compact_generate", raising=False)
    serve.main()
    assert calls == ["build_app", "main:app"]
    assert "no compact generate route" in caplog.text
    assert "vLLM's own /pause" in caplog.text  # nor an AsyncLLM to give the quick pause


def test_the_quick_pause_makes_vllms_two_calls_and_no_more(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    _fake_vllm(monkeypatch, [])
    async_llm = _fake_async_llm(monkeypatch, calls)
    slept: list[float] = []

    async def no_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    monkeypatch.delitem(sys.modules, "vime_rollout.vllm_ext.compact_generate", raising=False)
    serve.main()
    assert async_llm.pause_generation is quick_pause.pause_generation  # type: ignore[attr-defined]
    engine = async_llm()
    asyncio.run(engine.pause_generation(mode="keep", clear_cache=False))
    asyncio.run(engine.pause_generation())
    asyncio.run(engine.pause_generation(wait_for_inflight_requests=True))
    assert calls == [
        ("pause_scheduler", "keep", False),
        "clear_mm_cache",
        ("pause_scheduler", "abort", True),
        "clear_mm_cache",
        ("pause_scheduler", "wait", True),
    ]
    assert slept == []


def test_another_vllms_pause_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    async_llm = _fake_async_llm(monkeypatch, calls, vllm_026=False)
    own = async_llm.pause_generation  # type: ignore[attr-defined]
    reason = quick_pause.install()
    assert reason is not None and "not vLLM 0.26's" in reason
    assert async_llm.pause_generation is own  # type: ignore[attr-defined]
    asyncio.run(async_llm().pause_generation())
    assert calls == ["vllm's own"]
