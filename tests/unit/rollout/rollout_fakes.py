"""In-process stand-ins for the router data plane and the reward service, for the loop's unit tests.

`FakeGenerator` answers like vLLM's ``/inference/v1/generate`` (token ids, optional
``logprobs.content``, finish reason, usage) and records every request; `FakeScorer` scores with a
function of the sample. The integration tests use the real router, engines and reward service.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any

from vime_rollout.engines.commands import EngineCommand
from vime_rollout.engines.spec import EngineSpec

from vime.types import Sample


class FakeGenerator:
    """Replies after a short random delay; ``abort()`` makes in-flight requests finish with 'abort'."""

    def __init__(self, response_len: int = 3, delay_s: float = 0.002, seed: int = 0) -> None:
        self.response_len = response_len
        self.delay_s = delay_s
        self.rng = random.Random(seed)
        self.requests: list[tuple[dict[str, Any], str | None]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.abort_event = asyncio.Event()
        self.fail_next: list[BaseException | dict[str, Any]] = []
        self.hold_after: int | None = None
        """Requests after this many wait until `abort` (they then come back 'abort' with 1 token)."""

    async def abort(self) -> None:
        self.abort_event.set()

    async def generate(self, payload: dict[str, Any], *, session_id: str | None = None) -> dict[str, Any]:
        self.requests.append((payload, session_id))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.fail_next:
                item = self.fail_next.pop(0)
                if isinstance(item, BaseException):
                    raise item
                return item
            if self.hold_after is not None and len(self.requests) > self.hold_after:
                await self.abort_event.wait()
            else:
                await asyncio.sleep(self.delay_s * self.rng.random())
            sp = payload["sampling_params"]
            aborted = self.abort_event.is_set()
            n = 1 if aborted else min(self.response_len, sp["max_tokens"])
            tokens = [30 + (len(payload["token_ids"]) + k) % 10 for k in range(n)]
            return vllm_reply(tokens, "abort" if aborted else "stop", with_logprobs="logprobs" in sp)
        finally:
            self.in_flight -= 1


def vllm_reply(
    tokens: list[int], finish: str, with_logprobs: bool, version: str | None = None
) -> dict[str, Any]:
    """A vLLM 0.26-shaped generate reply (0.33 spans when ``version`` is given)."""
    choice: dict[str, Any] = {"index": 0, "token_ids": tokens, "finish_reason": finish, "logprobs": None}
    if with_logprobs:
        choice["logprobs"] = {"content": [{"token_id": t, "logprob": -0.5} for t in tokens]}
    if version is not None:
        choice["weight_versions"] = [{"version": version, "start": 0, "end": len(tokens)}]
    return {"choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": len(tokens)}}


class FakeScorer:
    """Scores each sample with ``fn(sample)``; records the size of every call."""

    def __init__(self, fn: Callable[[Sample], float]) -> None:
        self.fn = fn
        self.calls: list[int] = []

    async def score(self, samples: list[Sample]) -> list[tuple[float, dict[str, Any] | None]]:
        self.calls.append(len(samples))
        await asyncio.sleep(0)
        return [(float(self.fn(s)), {"status": "ok"}) for s in samples]


class StubControl:
    def __init__(self, url: str, world: StubWorld) -> None:
        self.base_url, self.world = url, world

    async def health(self) -> bool:
        return self.world.up.get(self.base_url, False)

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.world.calls.append((self.base_url, "sleep", (level, mode)))

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.world.calls.append((self.base_url, "wake_up", tuple(tags) if tags else None))

    async def abort_requests(self, request_ids: Sequence[str] | None = None) -> int | None:
        self.world.calls.append((self.base_url, "abort", None))
        return 0

    async def weight_version(self) -> str | None:
        return None

    async def finished_requests(self) -> float | None:
        return self.world.finished.get(self.base_url)

    async def logprobs_mode(self) -> str | None:
        return self.world.logprobs_mode.get(self.base_url, "processed_logprobs")

    async def serves_compact_generate(self) -> bool:
        return self.base_url not in self.world.plain_vllm

    async def aclose(self) -> None:
        return None


class StubProcess:
    def __init__(self, world: StubWorld, url: str) -> None:
        self.world, self.url, self.running = world, url, True

    def alive(self) -> bool | None:
        return self.running

    def stop(self) -> None:
        self.running = False
        self.world.up[self.url] = False

    def log_tail(self) -> str:
        return ""


class StubWorld:
    """Engines that come up when started; the launcher counts starts."""

    can_restart = True

    def __init__(self) -> None:
        self.up: dict[str, bool] = {}
        self.calls: list[tuple[str, str, Any]] = []
        self.starts: list[str] = []
        self.processes: dict[str, StubProcess] = {}
        self.registered: list[str] = []
        self.deregistered: list[str] = []
        self.held: set[str] = set()
        """What the stand-in router holds now."""
        self.finished: dict[str, float] = {}
        """What an engine's /metrics says it finished (absent: it does not say)."""
        self.logprobs_mode: dict[str, str | None] = {}
        self.plain_vllm: set[str] = set()
        """Engines without vime's compact generate route."""
        """What an engine's /server_info says (default processed_logprobs; None: it does not say)."""

    def start(self, spec: EngineSpec, command: EngineCommand | None) -> StubProcess:
        self.starts.append(spec.url)
        self.up[spec.url] = True
        self.processes[spec.url] = StubProcess(self, spec.url)
        return self.processes[spec.url]

    async def register(self, url: str, *, gpu_ids: Sequence[int] = ()) -> None:
        self.registered.append(url)
        self.held.add(url)

    async def deregister(self, engine: str) -> bool:
        self.deregistered.append(engine)
        self.held.discard(engine)
        return True

    async def registered_urls(self) -> set[str]:
        return set(self.held)


def small_config(**extra: Any) -> Any:
    """The API tests' run: 2 prompts × 4 samples, 8-token responses, CPU ranks."""
    from vime.config import load_config

    over: dict[str, Any] = {
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 4,
        "micro_batch_size": 2,
        "rollout_max_response_len": 8,
        "rollout_max_context_len": 600,
        "rollout_num_gpus": 0,
        "actor_num_gpus_per_node": 0,
        "actor_num_cpu_ranks": 2,
        "tensor_model_parallel_size": 1,
        **extra,
    }
    return load_config(overrides=[f"{k}={v}" for k, v in over.items()])


def manager_starter(
    cfg: Any, tokenizer: Any, world: StubWorld, *, engines: int, run_id: str, **parts: Any
) -> Callable[[], Any]:
    """The app's ``start``: a RolloutManager over ``engines`` stub engines (ports 9100…), the tiny
    model, a `FakeScorer` of the sample's parity and ``parts`` (generator, train_data, eval_data, sink)."""
    from vime_rollout.engines.health import HealthMonitor
    from vime_rollout.manager import RolloutManager

    async def start() -> RolloutManager:
        group = stub_group(world, engines, base_port=9100)
        await group.start()
        return RolloutManager(
            cfg,
            run_id=run_id,
            tokenizer=tokenizer,
            model_name="tiny",
            engines=group,
            monitor=HealthMonitor(group, interval_s=60),
            scorer=FakeScorer(lambda s: float(s.index % 2)),
            **parts,
        )

    return start


def stub_group(world: StubWorld, n: int = 3, *, base_port: int = 9000) -> Any:
    """An EngineGroup of ``n`` stub engines of ``world`` (ports ``base_port`` + k), not started."""
    from vime_rollout.engines.group import EngineGroup

    specs = [EngineSpec(k, "reference", "127.0.0.1", base_port + k) for k in range(n)]
    return EngineGroup(
        specs,
        world,
        lambda s: EngineCommand(["x"]),
        lambda url: StubControl(url, world),
        world,
        startup_timeout_s=2,
    )
