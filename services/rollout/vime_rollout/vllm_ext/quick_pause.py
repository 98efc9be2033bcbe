"""vLLM's ``/pause`` without its fixed 20 ms wait (`serve` installs it before vLLM's CLI runs).

vLLM 0.26's ``AsyncLLM.pause_generation`` pauses the scheduler, then sleeps 0.02 s so that the
final outputs of aborted requests tend to reach their callers before ``/pause`` answers (its own
comment: not required for correctness). A weight push pauses every engine once, and those 20 ms
were a sixth of a Qwen3-4B shape's direct push. The replacement makes the same two calls — the
multimodal cache cleared when asked, the scheduler paused in the asked mode — and answers once the
scheduler is paused. Callers see the same states and replies (aborted requests still end with
``abort``), only the order of an abort's reply and ``/pause``'s answer is no longer nudged.
"""

from __future__ import annotations

import inspect
from typing import Any

_SIGNATURE = ("self", "mode", "wait_for_inflight_requests", "clear_cache")


async def pause_generation(
    self: Any,
    *,
    mode: str = "abort",
    wait_for_inflight_requests: bool | None = None,
    clear_cache: bool = True,
) -> None:
    """``AsyncLLM.pause_generation`` of vLLM 0.26 up to its closing ``asyncio.sleep(0.02)``."""
    if wait_for_inflight_requests:
        mode = "wait"
    if clear_cache:
        await self.renderer.clear_mm_cache_async()
    await self.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)


def install() -> str | None:
    """Replace ``AsyncLLM.pause_generation``; the reason it was not replaced, or None when it was.

    Only a method with vLLM 0.26's parameters is replaced: another vLLM keeps its own."""
    from vllm.v1.engine.async_llm import AsyncLLM

    params = tuple(inspect.signature(AsyncLLM.pause_generation).parameters)
    if params != _SIGNATURE:
        return f"AsyncLLM.pause_generation{params} is not vLLM 0.26's"
    AsyncLLM.pause_generation = pause_generation
    return None
