"""A process pool whose tasks can time out: a hung task's worker is killed and replaced.

A plain ProcessPoolExecutor cannot cancel a running task, and one wedged task would hold its
worker (and, once all are wedged, the pool) forever. Here each worker is a process with its own
pipe, handed out one task at a time. The service waits for the reply on the event loop; past the
task's timeout (plus a short grace for the worker's own soft timeout to answer) it SIGKILLs the
worker and starts a new one in the background while the other workers keep serving. A worker that
dies mid-task (``os._exit``, a segfault, the OOM killer) is noticed by the closed pipe and replaced
the same way. Workers fork from a warm fork server (`vime_reward._preload`), so a replacement is
ready in milliseconds.

`WorkerPool.run_stream` hands one worker many items at once (one pickle, one send) for batches
of cheap functions, where the per-task overhead would dominate. The worker answers item by item
(see `vime_reward.worker`), and each item has its own deadline counted from the previous item's
reply, so every item is timed, killed and replaced exactly as a task of its own would be; the
items after one that overran that deadline or killed its worker are reported as not run, for the
caller to run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import select
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal

from vime_reward.worker import worker_main

log = logging.getLogger("vime_reward.pool")

_DIRECT_SEND_BYTES = 32 * 1024
"""Tasks smaller than a pipe buffer are written from the event loop; larger ones from a thread."""


class PoolClosed(RuntimeError):
    """The pool was closed while a task waited for a worker."""


class WorkerStartError(RuntimeError):
    """A new worker did not report ready."""


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection
    tasks: int = 0
    poller: select.poll = field(init=False, repr=False)
    """Watches ``conn`` for a reply: one syscall, where ``conn.poll()`` builds a selector each time."""

    def __post_init__(self) -> None:
        self.poller = select.poll()
        self.poller.register(self.conn.fileno(), select.POLLIN)

    def has_message(self) -> bool:
        """Whether a reply (or EOF) can be read now; a closed pipe's recv raises at once."""
        return self.conn.closed or bool(self.poller.poll(0))


@dataclass
class TaskResult:
    """What became of one task: the worker's reply, or why there is none."""

    status: Literal["ok", "timeout", "error"]
    reply: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    elapsed_s: float = 0.0


class WorkerPool:
    """``await pool.run(task, timeout_s)`` on one of ``size`` worker processes."""

    def __init__(
        self,
        size: int,
        *,
        grace_s: float = 0.5,
        start_timeout_s: float = 60.0,
        memory_limit_mb: int | None = None,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        self.size = size
        self.memory_limit_bytes = memory_limit_mb * (1 << 20) if memory_limit_mb else None
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        self.restarts: Counter[str] = Counter()
        self.on_restart = on_restart
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["vime_reward._preload"])
        self._idle: asyncio.Queue[_Worker | None] = asyncio.Queue()
        self._workers: set[_Worker] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._waiting = 0
        self._busy = 0
        self._closed = False

    async def start(self) -> None:
        """Start every worker and wait until each reports ready."""
        workers = await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        for worker in workers:
            self._workers.add(worker)
            self._idle.put_nowait(worker)

    def stats(self) -> dict[str, Any]:
        """Pool state for /health and metrics."""
        alive = sum(1 for w in self._workers if w.process.is_alive())
        return {
            "workers": self.size,
            "alive": alive,
            "busy": self._busy,
            "queued": self._waiting,
            "restarts": dict(self.restarts),
        }

    async def run(self, task: dict[str, Any], timeout_s: float) -> TaskResult:
        """Run ``task`` on a free worker; time out after ``timeout_s`` of running (queueing excluded)."""
        task = {**task, "soft_timeout_s": timeout_s}
        data = pickle.dumps(task)
        worker = await self._checkout()
        self._busy += 1
        start = time.perf_counter()
        try:
            return await self._run_on(worker, data, timeout_s, start)
        finally:
            self._busy -= 1

    async def _checkout(self) -> _Worker:
        """A live idle worker; idle workers found dead are replaced and skipped."""
        while True:
            if self._closed:
                raise PoolClosed("the reward worker pool is closed")
            self._waiting += 1
            try:
                worker = await self._idle.get()
            finally:
                self._waiting -= 1
            if worker is None:
                self._idle.put_nowait(None)  # wake the next waiter too
                raise PoolClosed("the reward worker pool is closed")
            if worker.process.is_alive():
                return worker
            self._replace_soon(worker, "died_idle")

    async def run_stream(self, task: dict[str, Any], timeout_s: float) -> list[TaskResult | None]:
        """Score ``task["items"]`` in turn on one worker, each as its own one-item task would be.

        One `TaskResult` per item, each item under ``timeout_s``; ``None`` for items that never ran
        because an earlier one timed out or killed its worker (which is then replaced).
        """
        count = len(task["items"])
        data = pickle.dumps({**task, "kind": "stream", "soft_timeout_s": timeout_s})
        worker = await self._checkout()
        self._busy += 1
        try:
            return await self._stream_on(worker, data, count, timeout_s)
        finally:
            self._busy -= 1

    async def _run_on(self, worker: _Worker, data: bytes, timeout_s: float, start: float) -> TaskResult:
        try:
            await self._send(worker, data)
            reply = await self._recv(worker, timeout_s + self.grace_s)
        except TimeoutError:
            return self._timed_out(worker, timeout_s, start)
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            return await self._crashed(worker, exc, start)
        except asyncio.CancelledError:
            # The caller gave up; the worker is still busy. Take its reply (or kill it) later.
            self._spawn_background(self._drain(worker, start + timeout_s + self.grace_s, 1, 0.0))
            raise
        worker.tasks += 1
        self._idle.put_nowait(worker)
        return _task_result(reply, _since(start))

    async def _stream_on(
        self, worker: _Worker, data: bytes, count: int, timeout_s: float
    ) -> list[TaskResult | None]:
        results: list[TaskResult | None] = [None] * count
        step_s = timeout_s + self.grace_s
        done = 0
        start = time.perf_counter()  # when the current item started, as far as the service knows
        try:
            await self._send(worker, data)
            while done < count:
                reply = await self._recv(worker, start + step_s - time.perf_counter())
                if reply.get("index") != done:
                    raise EOFError(f"expected the reply for item {done}, got {reply.get('index')!r}")
                results[done] = _task_result(reply, float(reply.get("elapsed_s") or _since(start)))
                done += 1
                start = time.perf_counter()
        except TimeoutError:
            results[done] = self._timed_out(worker, timeout_s, start)
            return results
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            results[done] = await self._crashed(worker, exc, start)
            return results
        except asyncio.CancelledError:
            self._spawn_background(self._drain(worker, start + step_s, count - done, step_s))
            raise
        worker.tasks += 1
        self._idle.put_nowait(worker)
        return results

    async def _send(self, worker: _Worker, data: bytes) -> None:
        if len(data) <= _DIRECT_SEND_BYTES:
            worker.conn.send_bytes(data)
        else:
            await asyncio.to_thread(worker.conn.send_bytes, data)

    def _timed_out(self, worker: _Worker, timeout_s: float, start: float) -> TaskResult:
        self._replace_soon(worker, "timeout")
        return TaskResult("timeout", error=f"timed out after {timeout_s:g}s", elapsed_s=_since(start))

    async def _crashed(self, worker: _Worker, exc: BaseException, start: float) -> TaskResult:
        code = await self._reap(worker)
        self._replace_soon(worker, "crash", reaped=True)
        return TaskResult(
            "error",
            error=f"the reward worker died while scoring (exit code {code}; {type(exc).__name__})",
            elapsed_s=_since(start),
        )

    async def _recv(self, worker: _Worker, timeout_s: float) -> dict[str, Any]:
        """The worker's next message; TimeoutError past ``timeout_s``, EOFError if it died."""
        if not worker.has_message():
            loop = asyncio.get_running_loop()
            ready: asyncio.Future[None] = loop.create_future()
            fd = worker.conn.fileno()

            def wake() -> None:
                if not ready.done():
                    ready.set_result(None)

            loop.add_reader(fd, wake)
            try:
                await asyncio.wait_for(ready, max(timeout_s, 0.001))
            finally:
                loop.remove_reader(fd)
                # uvloop leaves a watched fd non-blocking; the pipe's send/recv expect blocking I/O.
                os.set_blocking(fd, True)
        message = worker.conn.recv()
        if not isinstance(message, dict):
            raise EOFError(f"unexpected message from worker: {type(message).__name__}")
        return message

    async def _drain(self, worker: _Worker, deadline: float, count: int, step_s: float) -> None:
        """Read the ``count`` replies still due (the first by ``deadline``, each next within
        ``step_s``), then take the worker back; kill and replace it if one is late."""
        try:
            for _ in range(count):
                await self._recv(worker, deadline - time.perf_counter())
                deadline = time.perf_counter() + step_s
        except (TimeoutError, EOFError, OSError, pickle.UnpicklingError):
            await self._replace(worker, "abandoned")
        else:
            self._idle.put_nowait(worker)

    def _replace_soon(self, worker: _Worker, reason: str, *, reaped: bool = False) -> None:
        self._spawn_background(self._replace(worker, reason, reaped=reaped))

    def _spawn_background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _replace(self, worker: _Worker, reason: str, *, reaped: bool = False) -> None:
        """Kill ``worker`` and start its successor, retrying with backoff if the start fails."""
        self._workers.discard(worker)
        if not reaped:
            await self._reap(worker)
        self.restarts[reason] += 1
        if self.on_restart is not None:
            self.on_restart(reason)
        log.warning("replacing reward worker pid %s (%s)", worker.process.pid, reason)
        delay = 0.1
        while not self._closed:
            try:
                new = await self._spawn()
            except WorkerStartError as exc:
                log.error("%s; retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if self._closed:
                await self._reap(new)
                return
            self._workers.add(new)
            self._idle.put_nowait(new)
            return

    async def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main, args=(child, self.memory_limit_bytes), name="vime-reward-worker", daemon=True
        )
        await asyncio.to_thread(process.start)
        child.close()
        worker = _Worker(process, parent)
        try:
            await self._recv(worker, self.start_timeout_s)
        except (TimeoutError, EOFError, OSError) as exc:
            await self._reap(worker)
            raise WorkerStartError(f"reward worker did not start: {type(exc).__name__}: {exc}") from exc
        return worker

    async def _reap(self, worker: _Worker) -> int | None:
        """SIGKILL the worker (if still running), wait for it, close its pipe; its exit code."""
        with contextlib.suppress(Exception):
            if worker.process.is_alive():
                worker.process.kill()
            await asyncio.to_thread(worker.process.join, 5)
        with contextlib.suppress(Exception):
            worker.conn.close()
        return worker.process.exitcode

    async def close(self) -> None:
        """Kill every worker; tasks still waiting for one get `PoolClosed`."""
        self._closed = True
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(self._reap(w) for w in list(self._workers)))
        self._workers.clear()
        self._idle.put_nowait(None)


def _task_result(reply: dict[str, Any], elapsed_s: float) -> TaskResult:
    """A worker's reply as a `TaskResult`."""
    if reply.get("ok"):
        return TaskResult("ok", reply, elapsed_s=elapsed_s)
    status: Literal["timeout", "error"] = "timeout" if reply.get("timeout") else "error"
    return TaskResult(status, reply, error=str(reply.get("error")), elapsed_s=elapsed_s)


def _since(start: float) -> float:
    return round(time.perf_counter() - start, 6)
