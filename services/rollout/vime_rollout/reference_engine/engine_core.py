"""The scheduler: continuous batching, and vLLM 0.26's pause / sleep / weight-update state machine.

One asyncio task loops: under the engine lock it admits waiting sequences (up to ``max_batch``
running, a padded-token budget per prefill pass), runs one prefill pass for the newcomers and
one decode pass for everything already running (in a worker thread, so the HTTP side keeps
answering), appends one token to each, and retires finished sequences. New requests join at
the next step — continuous batching, not waves. Control calls take the same lock, so they act
between two steps, never inside one.

The control semantics are vLLM 0.26's (read from its ``EngineCore``, ``Scheduler`` and
``Executor``): every pause mode queues new requests until resume (0.26 has no 503 — 0.33
added one for abort/wait); ``abort`` finishes everything tracked with ``finish_reason="abort"``;
``wait`` keeps decoding the running sequences and returns when they are done; ``keep`` freezes
them, and with ``clear_cache`` (the default) drops their KV so they are recomputed on resume.
Sleep = pause(mode) + dropping memory; a wake naming a tag that is not asleep is a no-op for
the whole call; the engine resumes by itself once nothing is asleep (even after a /pause);
``/is_sleeping`` is true while merely paused.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import EngineError
from .model_runner import ModelRunner
from .sampler import LogprobsMode, RowResult, RowSpec, sample
from .sequence import Decoder, Request, Sequence
from .weights import BucketError, bucket_path, read_shapes, read_tensors
from .worker import ReferenceWorker

log = logging.getLogger("vime.reference_engine")

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_TAGS = ("weights", "kv_cache")


class PauseState(enum.Enum):
    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"  # abort / wait: running sequences may finish, nothing new starts
    PAUSED_ALL = "paused_all"  # keep: nothing is scheduled


@dataclass
class Step:
    decode: list[Sequence]
    prefill: list[Sequence]


class EngineCore:
    """Queues, the step loop and every state transition of one engine."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_batch: int,
        seed: int = 0,
        prefill_token_budget: int = 8192,
        kv_cache_bytes: int | None = None,
        decode_text: Decoder | None = None,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        worker: ReferenceWorker | None = None,
    ) -> None:
        self.runner = runner
        self.worker = worker or ReferenceWorker(runner)
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self.max_batch = max_batch
        self.prefill_token_budget = prefill_token_budget
        self.kv_cache_bytes = kv_cache_bytes
        self.decode_text = decode_text
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.pause_state = PauseState.UNPAUSED
        self.sleeping_tags: set[str] = set()
        self.weight_version: str | None = None
        self.update_active = False
        self.steps = 0
        self.generated_tokens = 0
        self.finished_requests = 0
        self._shared = torch.Generator().manual_seed(seed)
        self._lock = asyncio.Lock()
        self._work = asyncio.Event()
        self._stepped = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    # ----- lifecycle and state -----------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="reference-engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for req in list(self.requests.values()):
            req.abort()

    @property
    def paused(self) -> bool:
        return self.pause_state is not PauseState.UNPAUSED

    @property
    def executor_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def is_sleeping(self) -> bool:
        """vLLM's ``EngineCore.is_sleeping``: paused, or any memory asleep."""
        return self.paused or self.executor_sleeping

    def add(self, request: Request) -> None:
        """Queue a request (held while paused or asleep, as vLLM 0.26 does)."""
        if request.request_id in self.requests:
            raise EngineError(f"request id {request.request_id!r} is already in flight", param="request_id")
        self.requests[request.request_id] = request
        request.future.add_done_callback(lambda _: self._finished(request.request_id))
        self.waiting.extend(request.sequences)
        self._work.set()

    def _finished(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.finished_requests += 1

    # ----- the step loop -----------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await self._work.wait()
            async with self._lock:
                step = self._schedule()
                if step is None:
                    self._work.clear()
                else:
                    try:
                        await self._execute(step)
                    except Exception:  # a failing pass must not kill the loop: fail its requests
                        log.exception("engine step failed; finishing its sequences with an error")
                        for seq in (*step.decode, *step.prefill):
                            seq.finish("error")
                        self.running = [s for s in self.running if not s.finished]
                        self._preempt_running()  # their KV rows are in an unknown state
            async with self._stepped:
                self._stepped.notify_all()

    def _schedule(self) -> Step | None:
        if self.pause_state is PauseState.PAUSED_ALL or self.executor_sleeping:
            return None
        admitted = self._admit() if self.pause_state is PauseState.UNPAUSED else []
        if not self.running and not admitted:
            return None
        return Step(decode=list(self.running), prefill=admitted)

    def _final_len(self, seq: Sequence) -> int:
        return min(len(seq.request.prompt) + seq.request.max_tokens, self.runner.max_model_len)

    def _admit(self) -> list[Sequence]:
        """Waiting sequences that fit: the batch limit, the prefill budget, and the KV-cache budget.

        The KV budget is checked against every admitted sequence's longest possible length, so a
        running sequence never has to be preempted for memory (vLLM's --kv-cache-memory-bytes).
        """
        admitted: list[Sequence] = []
        width = 0
        need_len = max((self._final_len(s) for s in self.running), default=0)
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            seq = self.waiting[0]
            if seq.finished:
                self.waiting.popleft()
                continue
            width = max(width, len(seq.tokens))
            new_len = max(need_len, self._final_len(seq))
            slots = len(self.running) + len(admitted) + 1
            busy = bool(self.running or admitted)
            if busy and width * (len(admitted) + 1) > self.prefill_token_budget:
                break
            if (
                busy
                and self.kv_cache_bytes
                and self.runner.kv.projected_nbytes(slots, new_len) > self.kv_cache_bytes
            ):
                break
            need_len = new_len
            admitted.append(self.waiting.popleft())
        return admitted

    async def _execute(self, step: Step) -> None:
        eos = self.runner.eos_ids
        specs = [s.row_spec(eos) for s in (*step.decode, *step.prefill)]
        row0 = len(self.running)
        self.running.extend(step.prefill)
        results = await asyncio.to_thread(self._compute, step, row0, specs)
        version = self.weight_version
        limit = self.runner.max_model_len
        for seq, res in zip((*step.decode, *step.prefill), results, strict=True):
            if not seq.finished:
                seq.append(res.token, res.logprob, res.top, version, eos, limit, self.decode_text)
        self.steps += 1
        self.generated_tokens += len(results)
        self._retire_finished()

    @property
    def _processed(self) -> bool:
        return self.logprobs_mode == "processed_logprobs"

    def _compute(self, step: Step, row0: int, specs: list[RowSpec]) -> list[RowResult]:
        """Runs in a worker thread while the lock is held: one decode pass, one prefill pass."""
        out: list[RowResult] = []
        n = len(step.decode)
        if step.decode:
            logits = self.runner.forward(
                0, [[s.tokens[-1]] for s in step.decode], [s.computed for s in step.decode]
            )
            out += sample(logits, specs[:n], self._shared, self._processed)
        if step.prefill:
            logits = self.runner.forward(row0, [s.tokens for s in step.prefill], [0] * len(step.prefill))
            out += sample(logits, specs[n:], self._shared, self._processed)
        return out

    def _retire_finished(self) -> None:
        """Drop finished sequences: out of the queue, and out of the batch by moving the last row in."""
        if any(s.finished for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.finished)
        i = 0
        while i < len(self.running):
            if not self.running[i].finished:
                i += 1
                continue
            last = self.running.pop()
            if i < len(self.running):
                self.runner.kv.move_row(len(self.running), i, last.computed)
                self.running[i] = last

    def _preempt_running(self) -> None:
        """Send running sequences back to the queue front; their KV is recomputed when rescheduled."""
        for seq in reversed(self.running):
            seq.computed = 0
            self.waiting.appendleft(seq)
        self.running.clear()
        self._work.set()

    def _abort(self, requests: Iterable[Request]) -> None:
        for req in list(requests):
            req.abort()
        self._retire_finished()

    async def _wait_until(self, predicate: Any) -> None:
        async with self._stepped:
            await self._stepped.wait_for(predicate)

    # ----- control: abort, pause, sleep --------------------------------------------------------

    async def abort(self, request_ids: list[str] | None) -> int:
        """Abort the named requests (vLLM external ids), or everything tracked; vLLM's count."""
        async with self._lock:
            if request_ids:
                self._abort(self.requests[r] for r in request_ids if r in self.requests)
                return len(request_ids)
            tracked = list(self.requests.values())
            self._abort(tracked)
            # vLLM counts its internal states: one per n=1 request, n children + 1 parent otherwise.
            return sum(1 if len(r.sequences) == 1 else len(r.sequences) + 1 for r in tracked)

    async def pause(self, mode: str, clear_cache: bool = True) -> None:
        if mode not in PAUSE_MODES:
            raise EngineError(f"Invalid pause mode: {mode}", param="mode")
        async with self._lock:
            if mode == "abort":
                self._abort(self.requests.values())
            self.pause_state = PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
            if mode == "keep" and clear_cache:
                self._preempt_running()
            self._work.set()
        if mode == "wait":
            await self._wait_until(lambda: not self.running)

    async def resume(self) -> None:
        async with self._lock:
            self.pause_state = PauseState.UNPAUSED
            self._work.set()

    async def sleep(self, level: int, mode: str) -> None:
        if level not in (0, 1, 2):
            raise EngineError(f"sleep level must be 0, 1 or 2, got {level}", param="level")
        await self.pause(mode, clear_cache=level >= 1)
        if level < 1:
            return
        async with self._lock:
            if self.executor_sleeping:
                log.warning("engine is already sleeping")
                return
            self._preempt_running()
            self.runner.free_kv_cache()
            self.runner.sleep_weights(level)
            self.sleeping_tags = set(SLEEP_TAGS)

    async def wake_up(self, tags: list[str] | None) -> None:
        async with self._lock:
            if tags is not None and "scheduling" in tags:
                tags = [t for t in tags if t != "scheduling"]
            if tags is None or tags:
                self._wake_memory(tags)
            if not self.executor_sleeping:
                self.pause_state = PauseState.UNPAUSED
                self._work.set()

    def _wake_memory(self, tags: list[str] | None) -> None:
        if not self.executor_sleeping:
            return
        if tags and any(t not in self.sleeping_tags for t in tags):
            log.warning(
                "tags %s are not all asleep (asleep: %s); nothing woken", tags, sorted(self.sleeping_tags)
            )
            return
        wake = set(tags) if tags else set(self.sleeping_tags)
        if "weights" in wake:
            self.runner.wake_weights()
        self.sleeping_tags -= wake  # the KV cache is allocated again by the next step

    async def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        """No prefix cache here; like vLLM, fails while running sequences hold KV unless told to reset them."""
        async with self._lock:
            if reset_running_requests:
                self._preempt_running()
                return True
            return not self.running

    # ----- control: weight updates -------------------------------------------------------------

    async def start_weight_update(self) -> None:
        if self.update_active:
            raise EngineError(
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first."
            )
        self.update_active = True

    async def update_weights(self, update_info: Any) -> None:
        """Load one bucket; a rejected bucket ends the update session, as in vLLM 0.26."""
        if not self.update_active:
            raise EngineError("start_weight_update must be called before update_weights.")
        try:
            async with self._lock:
                if not self.runner.weights_resident:
                    raise BucketError("weights are asleep: POST /wake_up?tags=weights before updating them")
                path = bucket_path(update_info)
                self.runner.check_tensors(read_shapes(path))
                tensors = await asyncio.to_thread(read_tensors, path)
                await asyncio.to_thread(self.runner.load_tensors, tensors)
        except ValueError as exc:
            self.update_active = False
            raise EngineError(str(exc), param="update_info") from exc

    async def finish_weight_update(self, weight_version: str | None) -> None:
        if not self.update_active:
            raise EngineError("finish_weight_update called without a matching start_weight_update.")
        self.update_active = False
        if weight_version is not None:
            self.weight_version = str(weight_version)

    async def set_weight_version(self, version: str) -> None:
        """vLLM 0.33's ``/update_weight_version``: the label only, no weights."""
        self.weight_version = version

    async def collective_rpc(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
        """Run ``method`` on the worker between two steps (vLLM: on every worker); one result per worker."""
        fn = getattr(self.worker, method, None)
        if method.startswith("_") or not callable(fn):
            raise EngineError(f"the worker has no method {method!r}", 500, "InternalServerError")
        async with self._lock:
            try:
                return [await asyncio.to_thread(fn, *args, **kwargs)]
            except Exception as exc:
                raise EngineError(
                    f"{method}: {type(exc).__name__}: {exc}", 500, "InternalServerError"
                ) from exc

    # ----- introspection -----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Counters for tests and benchmarks (``GET /debug/state``; not a vLLM route)."""
        return {
            "running": len(self.running),
            "waiting": sum(1 for s in self.waiting if not s.finished),
            "requests": len(self.requests),
            "pause_state": self.pause_state.value,
            "sleeping_tags": sorted(self.sleeping_tags),
            "weight_version": self.weight_version,
            "update_active": self.update_active,
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "finished_requests": self.finished_requests,
        }
