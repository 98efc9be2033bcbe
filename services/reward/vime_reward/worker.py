"""The pool worker process: runs reward functions in its main thread, one task at a time.

Running in a process's main thread is what math-verify's signal-based code expects, and it lets
the worker arm its own soft timeout (SIGALRM → `TaskTimeout`) so a task stuck in Python code ends
without losing the worker. Code stuck inside C (a huge integer power, a regex blow-up) ignores
signals; the service then kills the worker (see `vime_reward.pool`).

Protocol on the pipe: the worker sends ``{"ready": True, "pid": ...}`` once, then answers each
task dict with one reply dict; ``None`` or a closed pipe ends it. A ``stream`` task (`run_stream`)
is the exception: its items are scored one by one, each as a one-item ``score`` task under its
own soft timeout, and each gets its own reply as soon as it is done (with ``index`` and the
worker's ``elapsed_s``), so the service can keep a deadline per item.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import signal
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from vime.wire.reward import RewardRequest
from vime_reward.functions import BUILTINS, Outcome, as_outcome
from vime_reward.functions import user as user_functions
from vime_reward.functions.base import clip

MAX_REPLY_BYTES = 1 << 20
"""Replies larger than this (a user function's huge details) are replaced by an error."""


class TaskTimeout(BaseException):
    """Raised by the soft-timeout alarm; a BaseException so ``except Exception`` in user code misses it."""


def _on_alarm(_signum: int, _frame: Any) -> None:
    raise TaskTimeout()


def worker_main(conn: Connection, memory_limit_bytes: int | None = None) -> None:
    """Serve tasks from ``conn`` until it closes, within ``memory_limit_bytes`` of address space."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service stops us; ^C on its terminal must not
    if memory_limit_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    conn.send({"ready": True, "pid": os.getpid()})
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        replies = run_stream(task) if task.get("kind") == "stream" else iter([_answer(task)])
        for reply in replies:
            data = pickle.dumps(reply)
            if len(data) > MAX_REPLY_BYTES:
                error = f"the reply is {len(data)} bytes, over {MAX_REPLY_BYTES}"
                data = pickle.dumps({**_tags(reply), "ok": False, "error": error})
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                return


def run_stream(task: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The replies to a ``stream`` task: each item scored alone, as a one-item ``score`` task would be."""
    one = {key: value for key, value in task.items() if key != "items"}
    one["kind"] = "score"
    for index, item in enumerate(task["items"]):
        one["items"] = [item]
        start = time.perf_counter()
        reply = _answer(one)
        yield {**reply, "index": index, "elapsed_s": round(time.perf_counter() - start, 6)}


def _answer(task: dict[str, Any]) -> dict[str, Any]:
    try:
        return run_task(task)
    except TaskTimeout:  # the alarm fired just as the task ended
        return _timeout_reply(task)


def _tags(reply: dict[str, Any]) -> dict[str, Any]:
    """What a stream reply says about which item it answers."""
    return {key: reply[key] for key in ("index", "elapsed_s") if key in reply}


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    """Run one task under its soft timeout: ``resolve`` a user function, or ``score`` items."""
    soft = float(task.get("soft_timeout_s") or 0)
    if soft > 0:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, soft)
    try:
        if task["kind"] == "resolve":
            return {"ok": True, "value": user_functions.describe(task["fn"])}
        return {"ok": True, "results": [_outcome_dict(o) for o in score(task)]}
    except TaskTimeout:
        return _timeout_reply(task)
    except BaseException as exc:  # user code may raise anything, SystemExit included
        if isinstance(exc, KeyboardInterrupt):
            raise
        return {"ok": False, "error": f"{type(exc).__name__}: {clip(str(exc)) or '(no message)'}"}
    finally:
        if soft > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _timeout_reply(task: dict[str, Any]) -> dict[str, Any]:
    return {"ok": False, "timeout": True, "error": f"timed out after {task.get('soft_timeout_s')}s"}


def score(task: dict[str, Any]) -> list[Outcome]:
    """The outcomes of a score task: one per item, in order."""
    name: str = task["fn"]
    items: list[dict[str, Any]] = task["items"]
    builtin = BUILTINS.get(name)
    if builtin is not None:
        if builtin.score is None:
            raise ValueError(f"{name} does not run in the pool")
        opts = builtin.options.model_validate(task.get("options") or {})
        return [builtin.score(item["response"], item["label"], opts) for item in items]
    requests = [RewardRequest.model_validate(item) for item in items]
    if task.get("group"):
        values = user_functions.call(name, requests)
        if not isinstance(values, list | tuple) or len(values) != len(requests):
            got = len(values) if isinstance(values, list | tuple) else type(values).__name__
            raise TypeError(
                f"{name} scored a group of {len(requests)} and returned {got}, not a list of that length"
            )
        return [as_outcome(v) for v in values]
    return [as_outcome(user_functions.call(name, req)) for req in requests]


def _outcome_dict(outcome: Outcome) -> dict[str, Any]:
    """Plain data for the pipe: details made JSON-safe (a user function may return anything)."""
    try:
        details = json.loads(json.dumps(outcome.details or {}, default=repr, allow_nan=False))
    except ValueError:  # NaN/inf or a cycle: keep a readable trace instead of failing the sample
        details = {"unserializable": clip(repr(outcome.details))}
    return {"reward": float(outcome.reward), "pred": clip(outcome.pred), "details": details}
